"""Model definitions, their config parsing and weight loading."""

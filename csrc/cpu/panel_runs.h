// How the panel drivers (linear.cpp, int8_linear.cpp) split one call over the threads.
//
// The unit of work is one row tile of one panel: the kernel computes rows in register tiles,
// so a tile costs the same wherever it falls. The units are numbered panel-major and each
// thread takes an equal contiguous range of them, to within one tile. Before, tasks were
// (panel, block of 48 rows): with few panels the threads got unequal shares (9 panels of 48
// rows: 5 tasks against 4). On Zen 5 the two splits ran within the run-to-run spread of
// each other (SmolLM2's projections, 1-256 rows, native and AVX2 tiers); this one is kept
// as the drivers' one split, right for any row and thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_kernel_api.h"

namespace contbatch {

// rows [row0, row0 + rows) of one panel, in one kernel call.
struct PanelRun {
  int64_t panel;
  int64_t row0;
  int64_t rows;
  bool last;  // the thread's last run of the call: what follows in memory is not its to read
};

// Rows per kernel call at most, unless a kernel says otherwise (cpu::LinearKernels::run_rows).
constexpr int64_t kMaxPanelRunRows = cpu::kVectorRunRows;

// `bytes` (at least 64) of 64-byte aligned memory private to the calling thread, kept and
// grown across calls: one buffer per Owner type, so two users on one thread never share it.
template <class Owner>
char* thread_buffer(int64_t bytes) {
  struct alignas(64) CacheLine {
    char bytes[64];
  };
  thread_local std::vector<CacheLine> lines;
  lines.resize(std::max<size_t>({lines.size(), static_cast<size_t>((bytes + 63) / 64), 1}));
  return lines.front().bytes;
}

// Runs every panel x row tile of a call on the thread pool: each thread calls start() once,
// then run(PanelRun, scratch, started) over its range in order, at most max_run_rows rows a
// call, `started` being what its start() returned. `scratch`: scratch_bytes, 64-byte aligned,
// private to the thread and kept across calls, its first 64 bytes (the kernels' header: which
// panel the scratch holds widened) zeroed before the thread's first run of the call.
template <class Start, class Run>
void for_panel_runs_started(int64_t rows, int64_t panels, int64_t tile_rows, int64_t scratch_bytes,
                            const Start& start, const Run& run, int64_t max_run_rows = kMaxPanelRunRows) {
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;  // per panel
  const int64_t max_run_tiles = std::max<int64_t>(1, max_run_rows / tile_rows);
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    char* scratch = thread_buffer<Run>(scratch_bytes);
    std::memset(scratch, 0, 64);
    const auto started = start();
    for (int64_t unit = begin; unit < end;) {
      const int64_t panel = unit / tiles, row0 = unit % tiles * tile_rows;
      const int64_t stop = std::min({end, (panel + 1) * tiles, unit + max_run_tiles});
      run(PanelRun{panel, row0, std::min(rows, (stop - panel * tiles) * tile_rows) - row0, stop == end}, scratch,
          started);
      unit = stop;
    }
  });
}

// for_panel_runs_started with nothing to start: run(PanelRun, scratch).
template <class Run>
void for_panel_runs(int64_t rows, int64_t panels, int64_t tile_rows, int64_t scratch_bytes, const Run& run,
                    int64_t max_run_rows = kMaxPanelRunRows) {
  for_panel_runs_started(
      rows, panels, tile_rows, scratch_bytes, [] { return 0; },
      [&](PanelRun panel_run, void* scratch, int) { run(panel_run, scratch); }, max_run_rows);
}

}  // namespace contbatch

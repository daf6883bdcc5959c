// Runs independent tasks of the reference on all hardware threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace cuflash::reference {

// Calls fn(task) for every task in [0, num_tasks); tasks must not write the same memory.
// The first exception thrown by a task is rethrown on the calling thread.
template <class Fn>
void parallel_for(std::int64_t num_tasks, Fn&& fn) {
  const std::int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const std::int64_t num_threads = std::min(num_tasks, hardware);
  if (num_threads <= 1) {
    for (std::int64_t task = 0; task < num_tasks; ++task) fn(task);
    return;
  }
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&]() {
    for (std::int64_t task = next++; task < num_tasks; task = next++) {
      try {
        fn(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = num_tasks;  // stop handing out work
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(num_threads - 1));
  for (std::int64_t t = 1; t < num_threads; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& thread : threads) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace cuflash::reference

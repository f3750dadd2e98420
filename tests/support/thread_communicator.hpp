// In-process ranks for tests: `size` threads, one per rank, exchanging through shared slots. Every
// collective of distributed::ordered_communicator, sums added in rank order (what stage 3's tests need to run
// on several ranks without MPI). Host memory only.
#pragma once

#include <memkit/core/execution.hpp>
#include <memkit/distributed/communicator.hpp>

#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace memkit_test {

class thread_ranks {
 public:
  explicit thread_ranks(int size) : size_(size), slots_(static_cast<std::size_t>(size)), barrier_(size) {}
  int size() const noexcept { return size_; }

  class communicator {
   public:
    communicator(thread_ranks& g, int rank) : group_(&g), rank_(rank) {}
    int rank() const noexcept { return rank_; }
    int size() const noexcept { return group_->size_; }

    template <class T>
    void all_reduce(const memkit::host_executor&, const T* send, T* recv, std::int64_t count) const {
      std::vector<T> sum(static_cast<std::size_t>(count));
      post(send);
      for (std::int64_t i = 0; i < count; ++i) {
        T s = from(0, send)[i];
        for (int r = 1; r < size(); ++r) s += from(r, send)[i];
        sum[static_cast<std::size_t>(i)] = s;
      }
      group_->barrier_.arrive_and_wait();  // everyone has read every send buffer (send may be recv)
      std::memcpy(recv, sum.data(), sum.size() * sizeof(T));
    }
    template <class T>
    void reduce_scatter(const memkit::host_executor&, const T* send, T* recv, std::int64_t count) const {
      std::vector<T> sum(static_cast<std::size_t>(count));
      post(send);
      for (std::int64_t i = 0; i < count; ++i) {
        T s = from(0, send)[rank_ * count + i];
        for (int r = 1; r < size(); ++r) s += from(r, send)[rank_ * count + i];
        sum[static_cast<std::size_t>(i)] = s;
      }
      group_->barrier_.arrive_and_wait();
      std::memcpy(recv, sum.data(), sum.size() * sizeof(T));
    }
    template <class T>
    void all_gather(const memkit::host_executor&, const T* send, T* recv, std::int64_t count) const {
      post(send);
      for (int r = 0; r < size(); ++r)
        if (from(r, send) != recv + r * count)  // in place: rank r's part is already there
          std::memcpy(recv + r * count, from(r, send), static_cast<std::size_t>(count) * sizeof(T));
      group_->barrier_.arrive_and_wait();
    }
    template <class T>
    void all_to_all(const memkit::host_executor&, const T* send, T* recv, std::int64_t count) const {
      post(send);
      for (int r = 0; r < size(); ++r)
        std::memcpy(recv + r * count, from(r, send) + rank_ * count, static_cast<std::size_t>(count) * sizeof(T));
      group_->barrier_.arrive_and_wait();
    }
    template <class T>
    void broadcast(const memkit::host_executor&, T* data, std::int64_t count, int root) const {
      post(data);
      if (rank_ != root) std::memcpy(data, from(root, data), static_cast<std::size_t>(count) * sizeof(T));
      group_->barrier_.arrive_and_wait();
    }

   private:
    template <class T>
    void post(const T* p) const {
      group_->slots_[static_cast<std::size_t>(rank_)] = p;
      group_->barrier_.arrive_and_wait();
    }
    template <class T>
    const T* from(int r, const T*) const {
      return static_cast<const T*>(group_->slots_[static_cast<std::size_t>(r)]);
    }
    thread_ranks* group_;
    int rank_;
  };

  // Runs body(communicator) on every rank's thread; collect results per rank, check them after (doctest's
  // assertions are not thread-safe).
  void run(const std::function<void(const communicator&)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size_; ++r) threads.emplace_back([&, r] { body(communicator(*this, r)); });
    for (std::thread& t : threads) t.join();
  }

 private:
  int size_;
  std::vector<const void*> slots_;
  std::barrier<> barrier_;
};
static_assert(memkit::distributed::ordered_communicator<thread_ranks::communicator, memkit::host_executor>);

}  // namespace memkit_test

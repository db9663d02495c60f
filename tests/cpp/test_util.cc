#include "test_util.h"

#include <cstdio>
#include <cstdlib>

namespace hvd_test {

Watchdog::Watchdog(double seconds, std::string what) {
  thread_ = std::thread([this, seconds, what = std::move(what)] {
    std::unique_lock<std::mutex> lock(mu_);
    bool finished =
        cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; });
    if (!finished) {
      std::fprintf(stderr, "\nWATCHDOG: '%s' still running after %.1f s; aborting\n", what.c_str(),
                   seconds);
      std::fflush(stderr);
      std::abort();
    }
  });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

hvd::TcpOptions FastOptions() {
  hvd::TcpOptions o;
  o.connect_timeout_s = 5;
  o.io_timeout_s = 5;
  return o;
}

std::string StatusString(const hvd::Status& st) {
  return "code " + std::to_string(static_cast<int>(st.code())) + ": " + st.message();
}

hvd::Status MakeWorld(int n, const hvd::TcpOptions& options, World* world,
                      const std::string& prefix) {
  return MakeWorld(
      n, [&options](int) { return options; }, world, prefix);
}

hvd::Status MakeWorld(int n, const std::function<hvd::TcpOptions(int)>& options, World* world,
                      const std::string& prefix, const std::string& host) {
  world->server = std::make_unique<hvd::StoreServer>(host, 0, kSecret);
  if (!world->server->status().ok()) return world->server->status();
  world->clients.clear();
  world->clients.resize(n);
  world->transports.clear();
  world->transports.resize(n);
  std::vector<hvd::Status> st(n);
  int port = world->server->port();
  RunRanks(n, [&](int r) {
    st[r] = hvd::StoreClient::Connect(host, port, kSecret, 5.0, &world->clients[r]);
    if (!st[r].ok()) return;
    st[r] = hvd::TcpTransport::Create(world->clients[r].get(), prefix, r, n, kSecret, options(r),
                                      &world->transports[r]);
  });
  for (int r = 0; r < n; ++r) {
    if (!st[r].ok()) {
      return hvd::Status::Aborted("rank " + std::to_string(r) + ": " + st[r].message());
    }
  }
  return hvd::Status::Ok();
}

hvd::Status AllreduceUntil(World& w, int r, const std::atomic<bool>& stop, int* rounds) {
  const int n = w.size();
  while (true) {
    float x[2] = {1.0f, r == 0 && stop ? 1.0f : 0.0f};
    hvd::Status st = w.transports[r]->Allreduce(x, 2, hvd::DataType::kFloat32, hvd::ReduceOp::kSum);
    if (!st.ok()) return st;
    if (x[0] != static_cast<float>(n)) {
      return hvd::Status::Aborted("allreduce gave " + std::to_string(x[0]) + ", not " +
                                  std::to_string(n));
    }
    if (rounds != nullptr) ++*rounds;
    if (x[1] != 0) return hvd::Status::Ok();
  }
}

std::unique_ptr<hvd::StoreClient> ConnectClient(const hvd::StoreServer& server,
                                                const std::string& secret, double timeout_s) {
  std::unique_ptr<hvd::StoreClient> c;
  hvd::Status st = hvd::StoreClient::Connect("127.0.0.1", server.port(), secret, timeout_s, &c);
  EXPECT_TRUE(st.ok()) << StatusString(st);
  return c;
}

}  // namespace hvd_test

// In-process loopback transport: the test double of the conformance suite.
//
// Agents register in a process-wide directory by name; a blob's address is that name. Each agent runs one
// worker thread that executes its transfers in posting order: per descriptor pair a memcpy under the target's
// endpoint lock (after checking that the target still has the range registered), then the notification into
// the peer's queue, then the outcome. An endpoint outlives its transport only as a "gone" marker, so a peer
// that was destroyed makes transfers fail (kUnavailable) instead of touching freed memory.
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "transport/transport_base.h"

namespace kvtier::transport {
namespace {

class LoopbackTransport;

struct Endpoint {
  std::mutex mu;
  LoopbackTransport* owner = nullptr;  // null once the transport is gone
  // A peer asked for the address of one of this agent's regions (peer_region_address): it may write them
  // directly, which a disconnect cannot stop.
  std::atomic<bool> mapped_directly{false};
};

std::mutex g_directory_mu;
std::map<std::string, std::weak_ptr<Endpoint>>& directory() {
  static auto* d = new std::map<std::string, std::weak_ptr<Endpoint>>();
  return *d;
}

class LoopbackTransport final : public detail::TransportBase {
 public:
  LoopbackTransport(AgentIdentity identity, LoopbackOptions options)
      : TransportBase(std::move(identity), options.peer_secret),
        options_(options),
        self_(std::make_shared<Endpoint>()) {
    self_->owner = this;
  }

  Status start() {
    {
      std::lock_guard lock(g_directory_mu);
      auto& d = directory();
      auto it = d.find(identity().name);
      if (it != d.end() && !it->second.expired())
        return AlreadyExists(fmt::format("a loopback agent named '{}' exists in this process", identity().name));
      d[identity().name] = self_;
    }
    try {
      worker_ = std::thread([this] { run(); });
    } catch (const std::exception& e) {
      return Internal(fmt::format("loopback worker thread: {}", e.what()));
    }
    return Status::Ok();
  }

  ~LoopbackTransport() override {
    {
      std::lock_guard lock(g_directory_mu);
      auto& d = directory();
      auto it = d.find(identity().name);
      if (it != d.end() && it->second.lock() == self_) d.erase(it);
    }
    {
      std::lock_guard lock(self_->mu);  // no peer is copying into our memory after this
      self_->owner = nullptr;
    }
    {
      std::lock_guard lock(jobs_mu_);
      stop_ = true;
      // Transfers in the queue are cancelled; messages already sent are still delivered (the worker drains the
      // queue before it ends), as a connection flushes what was written to it: an endpoint's last words when it
      // closes (the prefill/decode protocol's 'X' and 'Q') reach the peer.
      for (auto& j : jobs_)
        if (j.id != 0) j.aborted->store(true);
    }
    jobs_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  std::string_view backend_name() const noexcept override { return "loopback"; }

  // Called by a peer's worker with our endpoint lock held.
  void deliver_from_peer(Notification n) { deliver(std::move(n)); }
  bool owns(const void* p, std::uint64_t bytes) const { return covers(p, bytes); }
  // Whether the agent behind `from` may still copy into our memory (under our endpoint lock).
  bool accepts(const Endpoint* from) const { return revoked_.count(from) == 0; }

 protected:
  Result<std::string> backend_register(RegionId, const MemoryRegion&) override { return std::string(); }
  void backend_deregister(RegionId) override {
    // The peer's worker checks coverage under our endpoint lock; taking it here orders the removal after any
    // copy in progress.
    std::lock_guard lock(self_->mu);
  }
  Result<std::string> backend_address() override { return identity().name; }

  Status backend_connect(PeerId peer, const detail::Blob& blob) override {
    std::shared_ptr<Endpoint> ep;
    {
      std::lock_guard lock(g_directory_mu);
      auto it = directory().find(blob.address);
      if (it != directory().end()) ep = it->second.lock();
    }
    if (!ep) return Unavailable(fmt::format("loopback agent '{}' is not in this process", blob.address));
    std::lock_guard lock(jobs_mu_);
    if (peers_.size() <= peer) peers_.resize(peer + 1);
    peers_[peer] = ep;
    return Status::Ok();
  }

  Status backend_post(XferId id, XferOp op, PeerId peer, std::vector<detail::ResolvedOp> ops,
                      std::string notification) override {
    if (options_.post_fault) KVTIER_RETURN_IF_ERROR(options_.post_fault(op));
    std::lock_guard lock(jobs_mu_);
    if (stop_) return Cancelled("loopback transport is shutting down");
    jobs_.push_back(Job{id, op, peer, peers_[peer], std::move(ops), std::move(notification),
                        std::make_shared<std::atomic<bool>>(false)});
    jobs_cv_.notify_all();
    return Status::Ok();
  }

  Status backend_send(PeerId peer, NotifKind kind, std::string message) override {
    std::shared_ptr<Endpoint> ep;
    {
      std::lock_guard lock(jobs_mu_);
      if (peer >= peers_.size()) return NotFound(fmt::format("peer {} is not connected", peer));
      ep = peers_[peer];
    }
    // Through the worker, so a notification never overtakes an earlier transfer's notification.
    std::lock_guard lock(jobs_mu_);
    jobs_.push_back(
        Job{0, XferOp::kWrite, peer, ep, {}, std::move(message), std::make_shared<std::atomic<bool>>(false), kind});
    jobs_cv_.notify_all();
    return Status::Ok();
  }

  bool backend_disconnect(PeerId peer) override {
    std::shared_ptr<Endpoint> ep;
    {
      std::lock_guard lock(jobs_mu_);
      if (peer < peers_.size()) ep = peers_[peer];
    }
    if (!ep) return true;
    // Under our endpoint lock, which the peer's worker holds for every copy into our memory: a copy in progress
    // ends first, and none starts after this.
    {
      std::lock_guard lock(self_->mu);
      revoked_.insert(ep.get());
    }
    return backend_revoked(peer);
  }
  // The worker's copies into our memory stopped at the disconnect; direct writes of a peer that was handed our
  // addresses stop only with that peer's transport.
  bool backend_revoked(PeerId peer) const override {
    if (!self_->mapped_directly.load()) return true;
    std::shared_ptr<Endpoint> ep;
    {
      std::lock_guard lock(jobs_mu_);
      if (peer < peers_.size()) ep = peers_[peer];
    }
    if (!ep) return false;
    std::lock_guard lock(ep->mu);
    return ep->owner == nullptr;
  }
  // One process: shared memory is plain memory the peer addresses as it is (backend_peer_address).
  Result<void*> backend_allocate_shared(std::uint64_t bytes) override {
    constexpr std::uint64_t kPage = 4096;
    if (bytes > std::numeric_limits<std::uint64_t>::max() - kPage)
      return InvalidArgument(fmt::format("allocate_shared: {} bytes", bytes));
    void* p = std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
    if (p == nullptr) return ResourceExhausted(fmt::format("allocate_shared: {} bytes", bytes));
    std::memset(p, 0, bytes);
    std::lock_guard lock(jobs_mu_);
    shared_.emplace_back(static_cast<std::byte*>(p));
    return p;
  }
  void backend_free_shared(void* p) override {
    std::lock_guard lock(jobs_mu_);
    std::erase_if(shared_, [p](const auto& s) { return s.get() == p; });
  }
  // One process: the peer's region is its own memory, at the address its blob carries.
  Result<void*> backend_peer_address(PeerId peer, std::uint32_t, const detail::Blob::Region& r) override {
    std::shared_ptr<Endpoint> ep;
    {
      std::lock_guard lock(jobs_mu_);
      if (peer >= peers_.size() || !peers_[peer]) return NotFound(fmt::format("peer {} is not connected", peer));
      ep = peers_[peer];
    }
    // Under the peer's endpoint lock, which its disconnect takes to revoke us: a peer that revoked this agent (and
    // may have reused the memory since) or is gone hands out no address, and one handed out before the revocation
    // is seen by the peer's backend_revoked (mapped_directly), which then waits for this transport to end.
    std::lock_guard lock(ep->mu);
    if (ep->owner == nullptr) return Unavailable(fmt::format("peer {} has closed its transport", peer));
    if (!ep->owner->accepts(self_.get()))
      return Unavailable(fmt::format("peer {} has disconnected this agent: its memory is not addressable", peer));
    ep->mapped_directly.store(true);
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(r.base));
  }

  void backend_abort(XferId id) override {
    std::lock_guard lock(jobs_mu_);
    for (auto& j : jobs_)
      if (j.id == id) j.aborted->store(true);
    if (current_ == id && current_aborted_) current_aborted_->store(true);
  }

 private:
  struct Job {
    XferId id = 0;  // 0: a bare notification
    XferOp op = XferOp::kWrite;
    PeerId peer = 0;
    std::shared_ptr<Endpoint> ep;
    std::vector<detail::ResolvedOp> ops;
    std::string notification;
    std::shared_ptr<std::atomic<bool>> aborted;
    NotifKind kind = NotifKind::kMessage;
  };

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(jobs_mu_);
        jobs_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
        current_ = job.id;
        current_aborted_ = job.aborted;
      }
      execute(job);
      std::lock_guard lock(jobs_mu_);
      current_ = 0;
      current_aborted_.reset();
    }
  }

  void execute(Job& job) {
    Status s;
    for (const auto& op : job.ops) {
      // An aborted transfer does not wait out the delay first: cancellation is what the delay stands in for.
      if (options_.op_delay.count() > 0 && !job.aborted->load()) std::this_thread::sleep_for(options_.op_delay);
      if (job.aborted->load()) {
        s = Aborted(fmt::format("transfer {} was aborted", job.id));
        break;
      }
      std::lock_guard lock(job.ep->mu);
      if (job.ep->owner == nullptr) {
        s = Unavailable(fmt::format("peer {} is gone", job.peer));
        break;
      }
      if (!job.ep->owner->accepts(self_.get())) {
        s = Unavailable(fmt::format("peer {} disconnected this agent", job.peer));
        break;
      }
      auto* remote = reinterpret_cast<std::byte*>(op.remote_addr);
      if (!job.ep->owner->owns(remote, op.bytes)) {
        s = FailedPrecondition(
            fmt::format("peer {} no longer has [{:#x}, +{}) registered", job.peer, op.remote_addr, op.bytes));
        break;
      }
      if (job.op == XferOp::kWrite)
        std::memcpy(remote, op.local_ptr, op.bytes);
      else
        std::memcpy(op.local_ptr, remote, op.bytes);
    }
    if (s.ok() && !job.aborted->load()) {
      std::lock_guard lock(job.ep->mu);
      if (job.ep->owner != nullptr && job.ep->owner->accepts(self_.get()))
        job.ep->owner->deliver_from_peer(Notification{identity().name, job.kind, job.notification});
      else if (job.id != 0)
        s = Unavailable(fmt::format("peer {} is gone or disconnected this agent", job.peer));
    }
    if (job.id == 0) {
      // A notification alone: its send returned long ago and no transfer carries its outcome; the peer being gone
      // shows in the agent's peer state.
      s.ignore_error();
      return;
    }
    if (!s.ok()) mark_failed_if_gone(job, s);
    finish_xfer(job.id, s);
    set_quiescent(job.id);
  }

  void mark_failed_if_gone(const Job& job, const Status& s) {
    if (s.code() == StatusCode::kUnavailable) mark_peer_failed(job.peer, s);
  }

  const LoopbackOptions options_;
  struct FreeShared {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::vector<std::unique_ptr<std::byte, FreeShared>> shared_;  // allocate_shared's memory (under jobs_mu_)
  std::shared_ptr<Endpoint> self_;
  mutable std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  std::vector<std::shared_ptr<Endpoint>> peers_;
  XferId current_ = 0;
  std::shared_ptr<std::atomic<bool>> current_aborted_;
  std::set<const Endpoint*> revoked_;  // under self_->mu: peers disconnected by this agent
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_loopback_transport(AgentIdentity identity, LoopbackOptions options) {
  KVTIER_RETURN_IF_ERROR(detail::check_agent_name(identity.name));
  KVTIER_RETURN_IF_ERROR(detail::check_peer_secret(options.peer_secret));
  if (identity.tp_size == 0 || identity.tp_rank >= identity.tp_size)
    return InvalidArgument(
        fmt::format("tensor-parallel rank {} of size {}: need rank < size", identity.tp_rank, identity.tp_size));
  auto t = std::make_unique<LoopbackTransport>(std::move(identity), options);
  KVTIER_RETURN_IF_ERROR(t->start());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvtier::transport

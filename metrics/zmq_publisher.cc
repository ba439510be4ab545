// ZmqEventPublisher: a queue filled by publish(), drained by one thread that owns the PUB and ROUTER
// sockets, encodes each batch, sends it and keeps it for replay.
#include "kvtier/metrics/zmq_publisher.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <charconv>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "kvtier/core/deadline.h"
#include "metrics/zmq_loader.h"

namespace kvtier::metrics {

namespace detail {
const ZmqApi* zmq_api() noexcept {
  static const ZmqApi* api = []() -> const ZmqApi* {
    void* h = dlopen("libzmq.so.5", RTLD_NOW | RTLD_LOCAL);
    if (!h) return nullptr;
    static ZmqApi a;
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      ok = ok && fn != nullptr;
    };
    sym(a.ctx_new, "zmq_ctx_new");
    sym(a.ctx_term, "zmq_ctx_term");
    sym(a.socket, "zmq_socket");
    sym(a.close, "zmq_close");
    sym(a.bind, "zmq_bind");
    sym(a.connect, "zmq_connect");
    sym(a.setsockopt, "zmq_setsockopt");
    sym(a.getsockopt, "zmq_getsockopt");
    sym(a.send, "zmq_send");
    sym(a.recv, "zmq_recv");
    sym(a.poll, "zmq_poll");
    sym(a.errno_, "zmq_errno");
    sym(a.strerror, "zmq_strerror");
    return ok ? &a : nullptr;
  }();
  return api;
}
}  // namespace detail

bool zmq_available() noexcept { return detail::zmq_api() != nullptr; }

namespace {
std::string be64(std::int64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(static_cast<std::uint64_t>(v) >> (56 - 8 * i));
  return s;
}
}  // namespace

struct ZmqEventPublisher::Impl {
  const detail::ZmqApi* z = nullptr;
  ZmqPublisherOptions opt;
  void* ctx = nullptr;
  void* pub = nullptr;
  void* router = nullptr;
  std::string endpoint, replay_endpoint;

  std::mutex mu;
  std::condition_variable cv, drained;
  std::deque<std::pair<std::uint64_t, std::vector<KvEvent>>> queue;
  std::uint64_t next_seq = 0, sent_seq = 0;  // sent_seq: batches handed to the PUB socket
  bool stopping = false;
  std::thread thread;
  // Serializes shutdown(): a second caller (another thread, or the destructor) waits for the first and then
  // finds the thread joined, instead of joining it too.
  std::mutex shutdown_mu;
  // Publisher thread only.
  std::deque<std::pair<std::uint64_t, std::string>> ring;

  Status zerr(std::string_view what) const {
    return Unavailable(fmt::format("zmq publisher: {}: {}", what, z->strerror(z->errno_())));
  }
  std::string last_endpoint(void* s) const {
    char buf[256] = {};
    size_t len = sizeof buf;
    if (z->getsockopt(s, ZMQ_LAST_ENDPOINT, buf, &len) != 0) return {};
    return std::string(buf);
  }
  void send_frames(void* s, std::initializer_list<std::string_view> frames) {
    std::size_t i = 0;
    for (std::string_view f : frames) {
      int flags = ++i < frames.size() ? ZMQ_SNDMORE : 0;
      // ZMQ_DONTWAIT: a PUB socket drops at its high-water mark anyway; a ROUTER drops for a gone peer.
      z->send(s, f.data(), f.size(), flags | ZMQ_DONTWAIT);
    }
  }
  void serve_replay() {
    // One request: identity, empty delimiter (REQ clients), 8-byte start sequence number.
    std::string frames[4];
    int n = 0;
    for (;;) {
      char buf[256];
      int got = z->recv(router, buf, sizeof buf, ZMQ_DONTWAIT);
      if (got < 0) return;
      if (n < 4) frames[n++].assign(buf, static_cast<std::size_t>(std::min<int>(got, sizeof buf)));
      int more = 0;
      size_t len = sizeof more;
      z->getsockopt(router, ZMQ_RCVMORE, &more, &len);
      if (!more) break;
    }
    const std::string& start_frame = frames[n - 1];
    if (n < 2 || start_frame.size() != 8) return;  // not a replay request: ignore it
    std::uint64_t start = 0;
    for (unsigned char c : start_frame) start = (start << 8) | c;
    const bool delimited = n >= 3 && frames[1].empty();
    for (const auto& [seq, payload] : ring) {
      if (seq < start) continue;
      if (delimited)
        send_frames(router, {frames[0], "", be64(static_cast<std::int64_t>(seq)), payload});
      else
        send_frames(router, {frames[0], be64(static_cast<std::int64_t>(seq)), payload});
    }
    if (delimited)
      send_frames(router, {frames[0], "", be64(-1), ""});
    else
      send_frames(router, {frames[0], be64(-1), ""});
  }
  void loop() {
    for (;;) {
      std::deque<std::pair<std::uint64_t, std::vector<KvEvent>>> batch;
      bool stop;
      {
        std::unique_lock lk(mu);
        if (queue.empty() && !stopping) cv.wait_for(lk, std::chrono::milliseconds(router ? 5 : 50));
        batch.swap(queue);
        stop = stopping;
      }
      for (auto& [seq, events] : batch) {
        EventBatch b{unix_time_now(), std::move(events), opt.data_parallel_rank};
        std::string payload = encode_msgpack(b, opt.encoding);
        send_frames(pub, {opt.topic, be64(static_cast<std::int64_t>(seq)), payload});
        if (opt.buffer_steps > 0) {
          ring.emplace_back(seq, std::move(payload));
          if (ring.size() > opt.buffer_steps) ring.pop_front();
        }
      }
      if (!batch.empty()) {
        std::lock_guard lk(mu);
        sent_seq = batch.back().first + 1;
        drained.notify_all();
      }
      if (router) {
        zmq_pollitem_t item{router, 0, ZMQ_POLLIN, 0};
        while (z->poll(&item, 1, 0) > 0 && (item.revents & ZMQ_POLLIN)) serve_replay();
      }
      if (stop && batch.empty()) return;
    }
  }
  void close_all() {
    int zero = 0;
    for (void* s : {pub, router})
      if (s) {
        z->setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
        z->close(s);
      }
    pub = router = nullptr;
    if (ctx) z->ctx_term(ctx);
    ctx = nullptr;
  }
};

namespace {

// What libzmq would take in another sense than written: it cuts an endpoint at a NUL byte and takes a TCP port
// modulo 65536 (tcp://127.0.0.1:99999 binds port 34463), so subscribers of the configured endpoint hear nothing.
Status check_endpoint(std::string_view what, const std::string& endpoint) {
  if (endpoint.find('\0') != std::string::npos)
    return InvalidArgument(fmt::format("zmq publisher: {} endpoint holds a NUL byte", what));
  if (endpoint.rfind("tcp://", 0) == 0) {
    const std::size_t colon = endpoint.rfind(':');
    const std::string_view port = std::string_view(endpoint).substr(colon + 1);
    if (colon < 6 || port.empty())
      return InvalidArgument(fmt::format("zmq publisher: {} endpoint '{}' names no port", what, endpoint));
    std::uint32_t p = 0;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
    if (port != "*" && (ec != std::errc() || end != port.data() + port.size() || p > 65535))
      return InvalidArgument(
          fmt::format("zmq publisher: {} endpoint '{}': port '{}' is not '*' or 0..65535", what, endpoint, port));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ZmqEventPublisher>> ZmqEventPublisher::create(ZmqPublisherOptions options) {
  const detail::ZmqApi* z = detail::zmq_api();
  if (!z) return Unavailable("zmq publisher: libzmq.so.5 cannot be loaded (install libzmq5)");
  if (options.endpoint.empty()) return InvalidArgument("zmq publisher: endpoint is empty");
  if (options.max_queue_batches == 0) return InvalidArgument("zmq publisher: max_queue_batches is 0");
  KVTIER_RETURN_IF_ERROR(check_endpoint("PUB", options.endpoint));
  if (!options.replay_endpoint.empty()) KVTIER_RETURN_IF_ERROR(check_endpoint("replay", options.replay_endpoint));
  auto impl = std::make_unique<Impl>();
  impl->z = z;
  impl->opt = std::move(options);
  impl->ctx = z->ctx_new();
  if (!impl->ctx) return impl->zerr("zmq_ctx_new");
  impl->pub = z->socket(impl->ctx, ZMQ_PUB);
  if (!impl->pub) {
    Status s = impl->zerr("socket(PUB)");
    impl->close_all();
    return s;
  }
  int hwm = 100000;
  z->setsockopt(impl->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
  if (z->bind(impl->pub, impl->opt.endpoint.c_str()) != 0) {
    Status s = impl->zerr(fmt::format("bind PUB to '{}'", impl->opt.endpoint));
    impl->close_all();
    return s;
  }
  impl->endpoint = impl->last_endpoint(impl->pub);
  if (!impl->opt.replay_endpoint.empty()) {
    impl->router = z->socket(impl->ctx, ZMQ_ROUTER);
    if (!impl->router || z->bind(impl->router, impl->opt.replay_endpoint.c_str()) != 0) {
      Status s = impl->zerr(fmt::format("bind ROUTER to '{}'", impl->opt.replay_endpoint));
      impl->close_all();
      return s;
    }
    impl->replay_endpoint = impl->last_endpoint(impl->router);
  }
  Impl* p = impl.get();
  p->thread = std::thread([p] { p->loop(); });
  return std::unique_ptr<ZmqEventPublisher>(new ZmqEventPublisher(std::move(impl)));
}

ZmqEventPublisher::ZmqEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ZmqEventPublisher::~ZmqEventPublisher() { shutdown().ignore_error(); }

const std::string& ZmqEventPublisher::endpoint() const noexcept { return impl_->endpoint; }
const std::string& ZmqEventPublisher::replay_endpoint() const noexcept { return impl_->replay_endpoint; }

Result<std::uint64_t> ZmqEventPublisher::publish(std::vector<KvEvent>&& events) {
  std::lock_guard lk(impl_->mu);
  if (impl_->stopping) return FailedPrecondition("zmq publisher: publish() after shutdown()");
  if (events.empty()) return impl_->next_seq;
  if (impl_->queue.size() >= impl_->opt.max_queue_batches)
    return ResourceExhausted(fmt::format("zmq publisher: {} batches queued (max_queue_batches)", impl_->queue.size()));
  const std::uint64_t seq = impl_->next_seq++;
  impl_->queue.emplace_back(seq, std::move(events));
  impl_->cv.notify_one();
  return seq;
}

Status ZmqEventPublisher::flush(std::chrono::milliseconds timeout) {
  std::unique_lock lk(impl_->mu);
  if (!impl_->drained.wait_until(lk, deadline_after(timeout), [&] { return impl_->sent_seq == impl_->next_seq; }))
    return TimedOut(fmt::format("zmq publisher: {} batches still queued after {} ms", impl_->next_seq - impl_->sent_seq,
                                timeout.count()));
  return Status::Ok();
}

Status ZmqEventPublisher::shutdown(std::chrono::milliseconds timeout) {
  std::lock_guard once(impl_->shutdown_mu);
  if (!impl_->thread.joinable()) return Status::Ok();
  Status flushed = flush(timeout);
  {
    std::lock_guard lk(impl_->mu);
    impl_->stopping = true;
    if (!flushed.ok()) impl_->queue.clear();  // the deadline passed: drop the rest rather than block
    impl_->cv.notify_one();
  }
  impl_->thread.join();
  impl_->close_all();
  return flushed;
}

}  // namespace kvtier::metrics

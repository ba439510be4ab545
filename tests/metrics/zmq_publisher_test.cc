#include "kvtier/metrics/zmq_publisher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "metrics/zmq_loader.h"
#include "sanitizers.h"

#if defined(KVTIER_TEST_TSAN)
// libzmq is not instrumented: ThreadSanitizer sees its threads' malloc/memcpy but not the lock-free
// queues that order them, and reports races inside it.
extern "C" const char* __tsan_default_suppressions() { return "called_from_lib:libzmq.so.5\n"; }
#endif

namespace kvtier::metrics {
namespace {

using detail::ZmqApi;

std::vector<std::string> recv_frames(const ZmqApi* z, void* s, int timeout_ms) {
  zmq_pollitem_t item{s, 0, ZMQ_POLLIN, 0};
  if (z->poll(&item, 1, timeout_ms) <= 0) return {};
  std::vector<std::string> frames;
  for (;;) {
    std::string buf(1 << 16, '\0');
    int n = z->recv(s, buf.data(), buf.size(), 0);
    if (n < 0) return {};
    buf.resize(static_cast<std::size_t>(n));
    frames.push_back(std::move(buf));
    int more = 0;
    size_t len = sizeof more;
    z->getsockopt(s, ZMQ_RCVMORE, &more, &len);
    if (!more) return frames;
  }
}

std::int64_t seq_of(const std::string& f) {
  std::uint64_t v = 0;
  for (unsigned char c : f) v = (v << 8) | c;
  return static_cast<std::int64_t>(v);
}

std::vector<KvEvent> step_events(std::uint64_t i) {
  return {BlockStored{{{i, i + 1}}, std::nullopt, {}, 16, std::nullopt, Medium::kGpu}};
}

// A subscriber that joined late (ZMQ's slow joiner drops what was sent before the subscription
// took effect) catches up from the replay socket: every batch from 0, in order, then the end marker.
TEST(ZmqPublisher, LateSubscriberCatchesUpThroughReplay) {
  if (!zmq_available()) GTEST_SKIP() << "libzmq.so.5 is not installed";
  const ZmqApi* z = detail::zmq_api();
  ZmqPublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:*";
  o.replay_endpoint = "tcp://127.0.0.1:*";
  o.topic = "kv-events";
  o.buffer_steps = 1000;
  auto pub = ZmqEventPublisher::create(o);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  for (std::uint64_t i = 0; i < 20; ++i) ASSERT_EQ((*pub)->publish(step_events(i)).value(), i);
  ASSERT_TRUE((*pub)->flush(std::chrono::seconds(5)).ok());

  void* ctx = z->ctx_new();
  void* sub = z->socket(ctx, ZMQ_SUB);
  ASSERT_EQ(z->setsockopt(sub, ZMQ_SUBSCRIBE, "kv-events", 9), 0);
  ASSERT_EQ(z->connect(sub, (*pub)->endpoint().c_str()), 0);
  // Publish until the subscription is live: the first batch seen live tells where the gap ends.
  std::int64_t first_live = -1;
  std::uint64_t next = 20;
  for (int tries = 0; tries < 200 && first_live < 0; ++tries) {
    ASSERT_TRUE((*pub)->publish(step_events(next++)).ok());
    auto f = recv_frames(z, sub, 50);
    if (f.size() == 3) {
      EXPECT_EQ(f[0], "kv-events");
      first_live = seq_of(f[1]);
      auto b = decode_msgpack(f[2]);
      ASSERT_TRUE(b.ok()) << b.status().to_string();
      EXPECT_EQ(b->events, step_events(static_cast<std::uint64_t>(first_live)));
    }
  }
  ASSERT_GE(first_live, 20) << "no live batch received";

  void* req = z->socket(ctx, ZMQ_DEALER);
  ASSERT_EQ(z->connect(req, (*pub)->replay_endpoint().c_str()), 0);
  const char start[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  z->send(req, "", 0, ZMQ_SNDMORE);  // the empty delimiter a REQ socket would add
  z->send(req, start, 8, 0);
  std::int64_t expect = 0;
  for (;;) {
    auto f = recv_frames(z, req, 5000);
    ASSERT_EQ(f.size(), 3u) << "replay reply frames";
    EXPECT_EQ(f[0], "");
    const std::int64_t seq = seq_of(f[1]);
    if (seq == -1) {
      EXPECT_TRUE(f[2].empty());
      break;
    }
    ASSERT_EQ(seq, expect);
    auto b = decode_msgpack(f[2]);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->events, step_events(static_cast<std::uint64_t>(seq)));
    ++expect;
  }
  EXPECT_GT(expect, first_live);  // the replay covered the gap and the live batches
  int zero = 0;
  for (void* s : {sub, req}) {
    z->setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    z->close(s);
  }
  z->ctx_term(ctx);
  EXPECT_TRUE((*pub)->shutdown().ok());
  EXPECT_EQ((*pub)->publish(step_events(0)).status().code(), StatusCode::kFailedPrecondition);
}

// A refused batch stayed in publish()'s by-value parameter and was destroyed: the caller had nothing to send again,
// so the consumer never heard of those changes. Now a refusal leaves the batch with the caller.
TEST(ZmqPublisher, RefusedBatchStaysWithTheCaller) {
  if (!zmq_available()) GTEST_SKIP() << "libzmq.so.5 is not installed";
  ZmqPublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:*";
  auto pub = ZmqEventPublisher::create(o);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  std::vector<KvEvent> batch = step_events(0);
  auto first = (*pub)->publish(std::move(batch));
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_EQ(*first, 0u);
  ASSERT_TRUE((*pub)->shutdown().ok());
  batch = step_events(1);
  auto refused = (*pub)->publish(std::move(batch));
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(batch, step_events(1));  // NOLINT(bugprone-use-after-move): a refusal does not move from it
}

// flush() waited with condition_variable::wait_for, whose now + timeout overflows for "forever"
// (milliseconds::max(), what Python's flush(1e300) became): it reported TimedOut at once while batches were queued.
TEST(ZmqPublisher, FlushWithoutALimitWaitsForTheQueue) {
  if (!zmq_available()) GTEST_SKIP() << "libzmq.so.5 is not installed";
  ZmqPublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:*";
  auto pub = ZmqEventPublisher::create(o);
  ASSERT_TRUE(pub.ok()) << pub.status().to_string();
  for (std::uint64_t i = 0; i < 20000; ++i) ASSERT_TRUE((*pub)->publish(step_events(i)).ok());
  const Status flushed = (*pub)->flush(std::chrono::milliseconds::max());
  EXPECT_TRUE(flushed.ok()) << flushed.to_string();
  for (std::uint64_t i = 0; i < 20000; ++i) ASSERT_TRUE((*pub)->publish(step_events(i)).ok());
  const Status closed = (*pub)->shutdown(std::chrono::milliseconds::max());
  EXPECT_TRUE(closed.ok()) << closed.to_string();
}

TEST(ZmqPublisher, BadEndpointNamesIt) {
  if (!zmq_available()) GTEST_SKIP() << "libzmq.so.5 is not installed";
  ZmqPublisherOptions o;
  o.endpoint = "nonsense://x";
  auto pub = ZmqEventPublisher::create(o);
  ASSERT_FALSE(pub.ok());
  EXPECT_NE(pub.status().message().find("nonsense://x"), std::string::npos);
}

// libzmq takes a TCP port modulo 65536 and cuts an endpoint at a NUL: tcp://127.0.0.1:99999 was bound as port 34463.
TEST(ZmqPublisher, EndpointsLibzmqWouldReadOtherwiseAreRefused) {
  if (!zmq_available()) GTEST_SKIP() << "libzmq.so.5 is not installed";
  for (const std::string& bad : {std::string("tcp://127.0.0.1:99999"), std::string("tcp://127.0.0.1:65536"),
                                 std::string("tcp://127.0.0.1:45\0"
                                             "999",
                                             22),
                                 std::string("tcp://127.0.0.1:"), std::string("tcp://127.0.0.1:12a")}) {
    ZmqPublisherOptions o;
    o.endpoint = bad;
    auto pub = ZmqEventPublisher::create(o);
    ASSERT_FALSE(pub.ok()) << bad;
    EXPECT_EQ(pub.status().code(), StatusCode::kInvalidArgument) << pub.status().to_string();
  }
  ZmqPublisherOptions o;
  o.endpoint = "tcp://127.0.0.1:*";
  o.replay_endpoint = "tcp://127.0.0.1:70000";
  auto pub = ZmqEventPublisher::create(o);
  ASSERT_FALSE(pub.ok());
  EXPECT_NE(pub.status().message().find("replay endpoint"), std::string::npos) << pub.status().to_string();
  o.replay_endpoint = "tcp://127.0.0.1:*";
  auto ok = ZmqEventPublisher::create(o);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
}

}  // namespace
}  // namespace kvtier::metrics

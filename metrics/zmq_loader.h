// Private to metrics/ and its tests: libzmq's C API, loaded with dlopen at the first use (see
// zmq_publisher.h for why it is not linked).
#pragma once

#include <zmq.h>

#include <cstddef>

namespace kvtier::metrics::detail {

struct ZmqApi {
  void* (*ctx_new)();
  int (*ctx_term)(void*);
  void* (*socket)(void*, int);
  int (*close)(void*);
  int (*bind)(void*, const char*);
  int (*connect)(void*, const char*);
  int (*setsockopt)(void*, int, const void*, size_t);
  int (*getsockopt)(void*, int, void*, size_t*);
  int (*send)(void*, const void*, size_t, int);
  int (*recv)(void*, void*, size_t, int);
  int (*poll)(zmq_pollitem_t*, int, long);
  int (*errno_)();
  const char* (*strerror)(int);
};

// nullptr when libzmq.so.5 (or one of its symbols) is missing.
const ZmqApi* zmq_api() noexcept;

}  // namespace kvtier::metrics::detail

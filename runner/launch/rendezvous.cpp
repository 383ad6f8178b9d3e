#include "runner/launch/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "runner/base/errors.h"

namespace composer {

namespace {

// A listening TCP socket bound to `addr` (a name or a literal, v4 or v6).
int listen_on(const std::string& addr, int port, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(addr.c_str(), service.c_str(), &hints, &found); rc != 0) {
    why = gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

int port_of(int fd) {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) return 0;
  return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> host_rendezvous(const std::string& addr, int port, std::chrono::milliseconds timeout,
                                                int* bound_port) {
  std::string why;
  const int fd = listen_on(addr, port, why);
  if (fd < 0) {
    throw UserError("cannot host the rendezvous on " + addr + ":" + std::to_string(port) + ": " + why +
                    (port != 0 ? "; choose another --master-port, or a --master-addr of this host"
                               : "; give a --master-addr of this host"));
  }
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port_of(fd));
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = timeout;
  o.masterListenFd = fd;  // the store serves this socket and closes it
  if (bound_port) *bound_port = o.port;
  return c10::make_intrusive<c10d::TCPStore>(addr, o);
}

}  // namespace composer

// The rendezvous store every rank of a job meets at (c10d's TCPStore), hosted
// by the launcher of a local job or by rank 0 under an external launcher.
#pragma once
#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace composer {

// The rendezvous store's server, listening on `addr`:`port` only (not on every
// address; port 0 picks a free one). A UserError names the address and the
// reason when the socket cannot be bound.
c10::intrusive_ptr<c10d::Store> host_rendezvous(const std::string& addr, int port, std::chrono::milliseconds timeout,
                                                int* bound_port = nullptr);

}  // namespace composer

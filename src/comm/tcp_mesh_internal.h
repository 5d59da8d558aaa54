// tcp_mesh_internal.h — what the transport's files share: the frame format and
// the state of each connection and posted operation. tcp_mesh.cpp: buffers,
// posting, abort and liveness; tcp_mesh_connect.cpp: the rendezvous (listen,
// connect with deadlines, hello and token); tcp_mesh_io.cpp: the mesh's thread
// (reading and writing frames). Internal to those three files.
#pragma once

#include "comm/tcp_mesh.h"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zeroshard::comm {

// The frame format: a named namespace, not an anonymous one, since TcpMesh::Peer
// (external linkage) holds FrameHeaders.
namespace tcp_mesh_detail {

constexpr uint32_t kFrameMagic = 0x5A535446;  // "ZSTF"
enum FrameType : uint32_t { kData = 1, kReady = 2, kClose = 3, kHeartbeat = 4 };
constexpr uint64_t kNoCulprit = ~uint64_t(0);
constexpr size_t kMaxReasonBytes = 1024;
// At most this many messages of one peer wait for a receive (each at most kEagerBytes: 32 MiB
// in all), and as many ready notices for sends: a peer that exceeds it is not following the
// protocol, and its connection breaks instead of growing this rank's memory.
constexpr size_t kMaxUnmatched = 4096;

// Precedes every frame on a connection (40 bytes). kData: bytes [offset,
// offset + bytes) of a message of `total` bytes follow. kReady: the sender of
// this frame posted a receive of `total` bytes for `slot`; with `total` 0 it
// withdraws that notice (the message came eagerly, without waiting for it). kClose: the sender
// closes the connection next; `slot` is the rank whose failure made it close
// (kNoCulprit: it closed on its own), and `bytes` bytes of text follow (at most
// kMaxReasonBytes): why it aborted, "" for a clean close.
// kHeartbeat: nothing follows; the sender is alive (written on an idle connection).
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t type = kData;
  uint64_t slot = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t total = 0;
};

}  // namespace tcp_mesh_detail

struct TcpMesh::Op {
  Buffer* buf = nullptr;
  int peer = -1;
  uint64_t slot = 0;
  char* ptr = nullptr;
  size_t bytes = 0;
  bool is_recv = false;
  size_t moved = 0;     // bytes sent or received so far
  bool active = false;  // a chunk is moving to or from `ptr` on the mesh's thread
  std::list<std::unique_ptr<Op>>::iterator self;
};

// Per connection. The socket, `in` and the `out_*` buffers belong to the mesh's
// thread; the rest is guarded by mu_.
struct TcpMesh::Peer {
  std::unique_ptr<boost::asio::ip::tcp::socket> socket;
  tcp_mesh_detail::FrameHeader in;                                          // the frame header being read
  std::vector<tcp_mesh_detail::FrameHeader> out_notices;                    // the ready notices being written
  tcp_mesh_detail::FrameHeader out_header;                                  // the data frame header being written
  std::vector<tcp_mesh_detail::FrameHeader> notices;                        // ready notices to write, ahead of data
  std::list<Op*> sends;                                    // sends cleared to go, written in order
  bool writing = false;                                    // a write chain is scheduled or running
  std::unordered_map<uint64_t, Op*> posted;                // receives not complete yet
  std::unordered_map<uint64_t, std::vector<char>> early;   // small messages that arrived first
  std::unordered_map<uint64_t, uint64_t> ready;            // ready notices (slot -> bytes posted) for sends not posted yet
  std::unordered_map<uint64_t, Op*> waiting;               // large sends waiting for a ready notice
  std::string broken;                                      // why the connection failed; "" if healthy
  uint64_t broken_order = 0;                               // 1 for the mesh's first break, 2 next, ...
  int culprit = -1;                                        // the rank the peer's kClose blamed
  bool closed_cleanly = false;                             // the peer's kClose blamed no one and gave no reason
  std::string close_reason;                                // the reason the peer's kClose gave
  std::string abort_frame;                                 // abort(): a kClose to write before closing
  std::string out_abort;                                   // that frame being written (the thread's)
  std::chrono::steady_clock::time_point last_heard;        // when a read from the peer last completed
  std::chrono::steady_clock::time_point last_sent;         // when a write to the peer last completed
  bool closing = false;                                    // write a kClose after the queued frames
  uint64_t close_culprit = tcp_mesh_detail::kNoCulprit;                     // what that kClose says
};

struct TcpMesh::Io {
  boost::asio::io_context ctx;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> guard{ctx.get_executor()};
  std::unique_ptr<boost::asio::steady_timer> abort_timer;  // the thread's: abort()'s closing deadline
  std::thread thread;
};

}  // namespace zeroshard::comm

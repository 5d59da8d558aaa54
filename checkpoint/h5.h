// h5.h — the few HDF5 (C API, 1.10) operations checkpoints need, with RAII
// handles and errors that name the file, the object and HDF5's own reason.
//
// Files are created with library version bounds (earliest, v1.10), so any
// HDF5 1.10 reader opens them. Not thread-safe across threads unless the HDF5
// library is (Debian's serial build is not): one thread does HDF5 at a time.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::checkpoint::h5 {

// Owns one hid_t and closes it with the matching H5*close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = -1;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  void reset();

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// Element types of datasets.
enum class Type { kFloat32, kFloat64, kInt64, kInt32, kUInt8, kUInt16 };
hid_t file_type(Type t);
hid_t memory_type(Type t);
size_t type_size(Type t);

// What reading a saved file takes, wherever its bytes are: a File on disk, or a
// rank file in the durable tier read dataset by dataset (durable.h).
//
// A read may land later, by complete(): a file in the store gathers the reads asked of it
// and fetches them together (neighbouring datasets in one ranged GET, several GETs at
// once). Until complete() returns, each read's `out` must stay allocated and unread.
// A File on disk reads at once.
class Readable {
 public:
  virtual ~Readable() = default;
  virtual bool has(const std::string& name) const = 0;
  virtual std::vector<uint64_t> dims(const std::string& name) const = 0;
  // Elements [offset, offset + count) of a 1-D dataset, converted to `type` in memory.
  virtual void read(const std::string& name, Type type, uint64_t offset, uint64_t count, void* out) const = 0;
  // The whole dataset, into `count` elements at `out`: a dataset of another
  // number of elements (any shape) is refused before anything is read.
  virtual void read_all(const std::string& name, Type type, uint64_t count, void* out) const = 0;
  // Every read asked so far has landed in its `out` (or this throws, naming what failed).
  virtual void complete() const {}
};

// Where a dataset a File wrote lies in it (contiguous, unfiltered: its bytes as
// they were in memory) and the xxh3 of those bytes, so that a reader can fetch
// it alone by a ranged read and verify it.
struct Extent {
  std::string name;
  Type type;
  std::vector<uint64_t> dims;
  uint64_t offset = 0, bytes = 0, xxh3 = 0;
};

class File : public Readable {
 public:
  // Creates (truncating) a file for writing.
  static File create(const std::string& path);
  static File open_read(const std::string& path);
  const std::string& path() const { return path_; }
  hid_t id() const { return file_.get(); }

  // A dataset of `dims` (product = element count of `data`), under its full
  // path ("/master/encoder.fc1.weight"; missing groups are created).
  void write(const std::string& name, Type type, const std::vector<uint64_t>& dims, const void* data);
  void set_attribute(const std::string& object, const std::string& name, int64_t value);
  void set_attribute(const std::string& object, const std::string& name, const std::string& value);
  int64_t int_attribute(const std::string& object, const std::string& name) const;
  std::string string_attribute(const std::string& object, const std::string& name) const;

  // A virtual dataset of `dims` whose elements (row-major) come from 1-D
  // source datasets in other files: piece k maps source elements
  // [src_offset, src_offset + count) to flat elements [flat_begin, flat_begin + count).
  struct VirtualPiece {
    std::string file;     // relative to this file's directory
    std::string dataset;
    uint64_t src_offset = 0, count = 0, flat_begin = 0;
    // Non-empty: the source has these dims and maps whole onto the whole
    // virtual dataset (same element count); the offsets are then unused.
    std::vector<uint64_t> whole_source_dims;
  };
  void write_virtual(const std::string& name, Type type, const std::vector<uint64_t>& dims,
                     const std::vector<VirtualPiece>& pieces);

  // The source file names a virtual dataset maps (empty for a plain dataset).
  std::vector<std::string> virtual_sources(const std::string& name) const;

  bool has(const std::string& name) const override;
  std::vector<uint64_t> dims(const std::string& name) const override;
  void read(const std::string& name, Type type, uint64_t offset, uint64_t count, void* out) const override;
  void read_all(const std::string& name, Type type, uint64_t count, void* out) const override;
  // Flushes HDF5's buffers and closes the file (then fsync it by path).
  void close();
  // The datasets write() wrote, in order; their xxh3 only when digest_datasets(true)
  // came first (a second pass over the bytes: only a durable tier's index needs it).
  const std::vector<Extent>& extents() const { return extents_; }
  void digest_datasets(bool on) { digest_ = on; }

 private:
  std::string path_;
  Handle file_;
  std::vector<Extent> extents_;
  bool digest_ = false;
};

// Turns off HDF5's printing of error stacks (errors are reported as exceptions).
void quiet_errors();

}  // namespace zeroshard::checkpoint::h5

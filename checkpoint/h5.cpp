// h5.cpp — HDF5 wrappers (see h5.h).
#include "h5.h"

#include "checksum.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>

namespace zeroshard::checkpoint::h5 {
namespace {

// The innermost description on HDF5's error stack: the reason in its own words.
std::string hdf5_reason() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* s = static_cast<std::string*>(data);
        if (n == 0 && e->desc != nullptr) *s = e->desc;
        return 0;
      },
      &out);
  return out.empty() ? std::string("unknown HDF5 error") : out;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  const std::string reason = hdf5_reason();
  H5Eclear2(H5E_DEFAULT);
  TORCH_CHECK(false, "checkpoint file '", path, "': ", what, " (HDF5: ", reason, ")");
}

hid_t check(hid_t id, const std::string& path, const std::string& what) {
  if (id < 0) fail(path, what);
  return id;
}

void check(herr_t status, const std::string& path, const char* what, const std::string& object) {
  if (status < 0) fail(path, std::string(what) + " '" + object + "'");
}

}  // namespace

void quiet_errors() {
  static std::once_flag once;
  std::call_once(once, [] {
    // HDF5's own exit handler closes every open file; after a failed write
    // (disk full) 1.10 crashes doing so. Files are closed by their owners.
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  });
}

void Handle::reset() {
  if (id_ >= 0 && close_ != nullptr) close_(id_);
  id_ = -1;
}

hid_t file_type(Type t) {
  switch (t) {
    case Type::kFloat32: return H5T_IEEE_F32LE;
    case Type::kFloat64: return H5T_IEEE_F64LE;
    case Type::kInt64: return H5T_STD_I64LE;
    case Type::kInt32: return H5T_STD_I32LE;
    case Type::kUInt8: return H5T_STD_U8LE;
    case Type::kUInt16: return H5T_STD_U16LE;
  }
  return -1;
}

hid_t memory_type(Type t) {
  switch (t) {
    case Type::kFloat32: return H5T_NATIVE_FLOAT;
    case Type::kFloat64: return H5T_NATIVE_DOUBLE;
    case Type::kInt64: return H5T_NATIVE_INT64;
    case Type::kInt32: return H5T_NATIVE_INT32;
    case Type::kUInt8: return H5T_NATIVE_UINT8;
    case Type::kUInt16: return H5T_NATIVE_UINT16;
  }
  return -1;
}

size_t type_size(Type t) {
  switch (t) {
    case Type::kFloat64:
    case Type::kInt64: return 8;
    case Type::kFloat32:
    case Type::kInt32: return 4;
    case Type::kUInt16: return 2;
    case Type::kUInt8: return 1;
  }
  return 0;
}

File File::create(const std::string& path) {
  quiet_errors();
  File f;
  f.path_ = path;
  Handle fapl(check(H5Pcreate(H5P_FILE_ACCESS), path, "creating a property list"), H5Pclose);
  // Readable by every HDF5 1.10 library.
  check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_EARLIEST, H5F_LIBVER_V110), path, "setting version bounds", "");
  f.file_ = Handle(check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), path, "cannot create it"),
                   H5Fclose);
  return f;
}

File File::open_read(const std::string& path) {
  quiet_errors();
  File f;
  f.path_ = path;
  f.file_ = Handle(check(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), path, "cannot open it as HDF5"),
                   H5Fclose);
  return f;
}

void File::write(const std::string& name, Type type, const std::vector<uint64_t>& dims, const void* data) {
  std::vector<hsize_t> d(dims.begin(), dims.end());
  Handle space(check(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), path_, "dataspace"), H5Sclose);
  Handle lcpl(check(H5Pcreate(H5P_LINK_CREATE), path_, "property list"), H5Pclose);
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), path_, "creating groups for", name);
  Handle ds(check(H5Dcreate2(file_.get(), name.c_str(), file_type(type), space.get(), lcpl.get(), H5P_DEFAULT,
                             H5P_DEFAULT),
                  path_, "cannot create dataset '" + name + "'"),
            H5Dclose);
  check(H5Dwrite(ds.get(), memory_type(type), H5S_ALL, H5S_ALL, H5P_DEFAULT, data), path_, "writing dataset", name);
  uint64_t n = 1;
  for (auto x : dims) n *= x;
  const uint64_t bytes = n * type_size(type);
  const haddr_t at = H5Dget_offset(ds.get());  // undefined for a dataset without elements
  TORCH_CHECK(bytes == 0 || at != HADDR_UNDEF, "checkpoint file '", path_, "': dataset '", name, "' has no place in it");
  extents_.push_back({name, type, dims, bytes == 0 ? 0 : static_cast<uint64_t>(at), bytes,
                      digest_ ? digest_bytes(data, bytes) : 0});
}

namespace {

// Splits the flat (row-major) range [b, e) of a tensor of `shape` into
// hyperslab blocks: (start, count) per block, in order.
void blocks(uint64_t b, uint64_t e, const std::vector<uint64_t>& shape, size_t dim,
            std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>>* out) {
  if (b >= e) return;
  const size_t rank = shape.size();
  if (dim + 1 == rank) {
    std::vector<hsize_t> start(rank, 0), count(rank, 1);
    start[dim] = b;
    count[dim] = e - b;
    out->push_back({start, count});
    return;
  }
  uint64_t inner = 1;
  for (size_t i = dim + 1; i < rank; ++i) inner *= shape[i];
  auto prefix = [&](std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> sub, uint64_t row,
                    uint64_t rows) {
    for (auto& [st, ct] : sub) {
      st[dim] = row;
      ct[dim] = rows;
      out->push_back({st, ct});
    }
  };
  uint64_t r0 = b / inner;
  const uint64_t r_end = e / inner;  // rows [r0, r_end) may be whole
  if (b % inner != 0 || r0 == r_end) {  // a partial first row (or the whole range inside one row)
    std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> sub;
    const uint64_t row_end = std::min(e, (r0 + 1) * inner);
    blocks(b - r0 * inner, row_end - r0 * inner, shape, dim + 1, &sub);
    prefix(std::move(sub), r0, 1);
    if (row_end == e) return;
    ++r0;
  }
  if (r_end > r0) {
    std::vector<hsize_t> start(rank, 0), count(shape.begin(), shape.end());
    start[dim] = r0;
    count[dim] = r_end - r0;
    for (size_t i = 0; i < dim; ++i) count[i] = 1;
    out->push_back({start, count});
  }
  if (e % inner != 0) {
    std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> sub;
    blocks(0, e % inner, shape, dim + 1, &sub);
    prefix(std::move(sub), r_end, 1);
  }
}

}  // namespace

void File::write_virtual(const std::string& name, Type type, const std::vector<uint64_t>& dims,
                         const std::vector<VirtualPiece>& pieces) {
  std::vector<uint64_t> shape = dims.empty() ? std::vector<uint64_t>{1} : dims;
  std::vector<hsize_t> d(shape.begin(), shape.end());
  Handle vspace(check(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), path_, "dataspace"), H5Sclose);
  Handle dcpl(check(H5Pcreate(H5P_DATASET_CREATE), path_, "property list"), H5Pclose);
  for (const auto& p : pieces) {
    if (!p.whole_source_dims.empty()) {
      std::vector<hsize_t> sd(p.whole_source_dims.begin(), p.whole_source_dims.end());
      Handle sspace(check(H5Screate_simple(static_cast<int>(sd.size()), sd.data(), nullptr), path_, "dataspace"),
                    H5Sclose);
      check(H5Sselect_all(vspace.get()), path_, "selecting", name);
      check(H5Pset_virtual(dcpl.get(), vspace.get(), p.file.c_str(), p.dataset.c_str(), sspace.get()), path_,
            "mapping the source of", name);
      continue;
    }
    std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> bl;
    blocks(p.flat_begin, p.flat_begin + p.count, shape, 0, &bl);
    hsize_t src_pos = p.src_offset;
    for (const auto& [start, count] : bl) {
      hsize_t n = 1;
      for (auto c : count) n *= c;
      check(H5Sselect_hyperslab(vspace.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr), path_,
            "selecting in", name);
      hsize_t src_total = p.src_offset + p.count;
      Handle sspace(check(H5Screate_simple(1, &src_total, nullptr), path_, "dataspace"), H5Sclose);
      check(H5Sselect_hyperslab(sspace.get(), H5S_SELECT_SET, &src_pos, nullptr, &n, nullptr), path_, "selecting in",
            p.dataset);
      check(H5Pset_virtual(dcpl.get(), vspace.get(), p.file.c_str(), p.dataset.c_str(), sspace.get()), path_,
            "mapping a source of", name);
      src_pos += n;
    }
  }
  check(H5Sselect_all(vspace.get()), path_, "selecting", name);
  Handle lcpl(check(H5Pcreate(H5P_LINK_CREATE), path_, "property list"), H5Pclose);
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), path_, "creating groups for", name);
  Handle ds(check(H5Dcreate2(file_.get(), name.c_str(), file_type(type), vspace.get(), lcpl.get(), dcpl.get(),
                             H5P_DEFAULT),
                  path_, "cannot create virtual dataset '" + name + "'"),
            H5Dclose);
}

void File::set_attribute(const std::string& object, const std::string& name, int64_t value) {
  Handle space(check(H5Screate(H5S_SCALAR), path_, "dataspace"), H5Sclose);
  Handle attr(check(H5Acreate_by_name(file_.get(), object.c_str(), name.c_str(), H5T_STD_I64LE, space.get(),
                                      H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                    path_, "cannot create attribute '" + name + "' of '" + object + "'"),
              H5Aclose);
  check(H5Awrite(attr.get(), H5T_NATIVE_INT64, &value), path_, "writing attribute", name);
}

void File::set_attribute(const std::string& object, const std::string& name, const std::string& value) {
  Handle type(check(H5Tcopy(H5T_C_S1), path_, "string type"), H5Tclose);
  check(H5Tset_size(type.get(), value.empty() ? 1 : value.size()), path_, "string size of", name);
  Handle space(check(H5Screate(H5S_SCALAR), path_, "dataspace"), H5Sclose);
  Handle attr(check(H5Acreate_by_name(file_.get(), object.c_str(), name.c_str(), type.get(), space.get(),
                                      H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                    path_, "cannot create attribute '" + name + "' of '" + object + "'"),
              H5Aclose);
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  check(H5Awrite(attr.get(), type.get(), padded.data()), path_, "writing attribute", name);
}

int64_t File::int_attribute(const std::string& object, const std::string& name) const {
  Handle attr(check(H5Aopen_by_name(file_.get(), object.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), path_,
                    "no attribute '" + name + "' on '" + object + "'"),
              H5Aclose);
  int64_t v = 0;
  check(H5Aread(attr.get(), H5T_NATIVE_INT64, &v), path_, "reading attribute", name);
  return v;
}

std::string File::string_attribute(const std::string& object, const std::string& name) const {
  Handle attr(check(H5Aopen_by_name(file_.get(), object.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), path_,
                    "no attribute '" + name + "' on '" + object + "'"),
              H5Aclose);
  Handle type(check(H5Aget_type(attr.get()), path_, "attribute type of '" + name + "'"), H5Tclose);
  const size_t n = H5Tget_size(type.get());
  std::string v(n, '\0');
  check(H5Aread(attr.get(), type.get(), v.data()), path_, "reading attribute", name);
  while (!v.empty() && v.back() == '\0') v.pop_back();
  return v;
}

std::vector<std::string> File::virtual_sources(const std::string& name) const {
  Handle ds(check(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), path_, "no dataset '" + name + "'"), H5Dclose);
  Handle dcpl(check(H5Dget_create_plist(ds.get()), path_, "properties of '" + name + "'"), H5Pclose);
  std::vector<std::string> out;
  if (H5Pget_layout(dcpl.get()) != H5D_VIRTUAL) return out;
  size_t n = 0;
  check(H5Pget_virtual_count(dcpl.get(), &n), path_, "virtual mappings of", name);
  for (size_t i = 0; i < n; ++i) {
    const ssize_t len = H5Pget_virtual_filename(dcpl.get(), i, nullptr, 0);
    std::string s(static_cast<size_t>(std::max<ssize_t>(len, 0)) + 1, '\0');
    H5Pget_virtual_filename(dcpl.get(), i, s.data(), s.size());
    s.resize(static_cast<size_t>(std::max<ssize_t>(len, 0)));
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

bool File::has(const std::string& name) const {
  // Every group on the way must exist for H5Lexists to answer.
  size_t pos = 0;
  while ((pos = name.find('/', pos + 1)) != std::string::npos) {
    if (H5Lexists(file_.get(), name.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  }
  return H5Lexists(file_.get(), name.c_str(), H5P_DEFAULT) > 0;
}

std::vector<uint64_t> File::dims(const std::string& name) const {
  Handle ds(check(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), path_, "no dataset '" + name + "'"), H5Dclose);
  Handle space(check(H5Dget_space(ds.get()), path_, "dataspace of '" + name + "'"), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> d(static_cast<size_t>(std::max(rank, 0)));
  H5Sget_simple_extent_dims(space.get(), d.data(), nullptr);
  return {d.begin(), d.end()};
}

void File::read(const std::string& name, Type type, uint64_t offset, uint64_t count, void* out) const {
  Handle ds(check(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), path_, "no dataset '" + name + "'"), H5Dclose);
  Handle space(check(H5Dget_space(ds.get()), path_, "dataspace of '" + name + "'"), H5Sclose);
  TORCH_CHECK(H5Sget_simple_extent_ndims(space.get()) == 1, "checkpoint file '", path_, "': dataset '", name,
              "' is not 1-D");
  hsize_t n = 0;
  H5Sget_simple_extent_dims(space.get(), &n, nullptr);
  TORCH_CHECK(offset + count <= n, "checkpoint file '", path_, "': dataset '", name, "' has ", n,
              " elements; elements [", offset, ", ", offset + count, ") were asked for (a truncated or foreign file?)");
  const hsize_t start = offset, cnt = count;
  check(H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, &start, nullptr, &cnt, nullptr), path_, "selecting in", name);
  Handle mem(check(H5Screate_simple(1, &cnt, nullptr), path_, "memory dataspace"), H5Sclose);
  check(H5Dread(ds.get(), memory_type(type), mem.get(), space.get(), H5P_DEFAULT, out), path_, "reading dataset", name);
}

void File::read_all(const std::string& name, Type type, uint64_t count, void* out) const {
  Handle ds(check(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), path_, "no dataset '" + name + "'"), H5Dclose);
  Handle space(check(H5Dget_space(ds.get()), path_, "dataspace of '" + name + "'"), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  TORCH_CHECK(n >= 0 && static_cast<uint64_t>(n) == count, "checkpoint file '", path_, "': dataset '", name, "' has ",
              n, " elements where its manifest entry describes ", count,
              " (a file edited or written by another program?): refusing to read it");
  check(H5Dread(ds.get(), memory_type(type), H5S_ALL, H5S_ALL, H5P_DEFAULT, out), path_, "reading dataset", name);
}

void File::close() {
  if (file_.get() >= 0) check(H5Fflush(file_.get(), H5F_SCOPE_GLOBAL), path_, "flushing", "");
  file_.reset();
}

}  // namespace zeroshard::checkpoint::h5

// Saved contexts: the committed rows of a store on disk, and back.
//
// File: "OGKVCTX1", u32 format, u32 + identity bytes, u64 length, u32 tensors,
// then per tensor u64 first position, u64 rows, u64 row bytes; the rows of
// every tensor in position order; then the CRC-32 of each 4 MiB block of all
// that precedes it and a u32 count of them. Only committed rows are written: no
// capacity padding. The CRCs catch damage (format 1's SHA-256 held save and load
// to ~0.2 GB/s on one core); every header field is still checked on load, and
// the rows are KV values the model reads, never sizes or offsets.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <limits>
#include <vector>

#include "checksum.h"
#include "kv_store.h"

namespace offgraph_kv {

namespace {

constexpr char kMagic[8] = {'O', 'G', 'K', 'V', 'C', 'T', 'X', '1'};
constexpr uint32_t kFormat = 2;
constexpr size_t kCrcBlock = size_t(4) << 20;

template <typename T>
void put(std::vector<char>* out, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  out->insert(out->end(), p, p + sizeof(T));
}

// Reads from a byte range, failing (not crashing) past its end.
class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), left_(size) {}
  template <typename T>
  bool get(T* v) {
    if (left_ < sizeof(T)) return false;
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    left_ -= sizeof(T);
    return true;
  }
  const char* take(size_t n) {
    if (left_ < n) return nullptr;
    const char* at = p_;
    p_ += n;
    left_ -= n;
    return at;
  }
  size_t left() const { return left_; }

 private:
  const char* p_;
  size_t left_;
};

struct Span {
  uint64_t first = 0, rows = 0, row_bytes = 0;
};

Status bad_file(const std::string& path, const std::string& what) {
  return Status(Error::InvalidArgument, "saved context " + path + ": " + what);
}

// Whether `path` names something other than a regular file (a directory, a
// device, a FIFO): a context is neither read from nor renamed onto one.
bool exists_but_not_regular(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
}

}  // namespace

Status KVStore::save_context(const std::string& path) const {
  const std::lock_guard<std::mutex> held(access_);
  if (pending_ != 0) return Status(Error::InvalidState, "save during a step");
  if (exists_but_not_regular(path))
    return Status(Error::InvalidArgument, "cannot save a context to " + path + ": it exists and is not a regular file");
  std::vector<Span> spans(tensors_.size());
  size_t data_bytes = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    spans[i].first = tensors_[i].kind == LayerKind::Ring ? kept_from_[i] : 0;
    spans[i].rows = length_ - spans[i].first;
    spans[i].row_bytes = tensors_[i].row_bytes();
    data_bytes += spans[i].rows * spans[i].row_bytes;
  }
  std::vector<char> out;
  const size_t body_bytes = sizeof(kMagic) + 20 + identity_.size() + 24 * spans.size() + data_bytes;
  out.reserve(body_bytes + 4 * (body_bytes / kCrcBlock + 2));
  out.insert(out.end(), kMagic, kMagic + sizeof(kMagic));
  put(&out, kFormat);
  put(&out, uint32_t(identity_.size()));
  out.insert(out.end(), identity_.begin(), identity_.end());
  put(&out, uint64_t(length_));
  put(&out, uint32_t(tensors_.size()));
  for (const Span& s : spans) {
    put(&out, s.first);
    put(&out, s.rows);
    put(&out, s.row_bytes);
  }
  const auto turn = control_turn();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Span& s = spans[i];
    const size_t at = out.size();
    out.resize(at + s.rows * s.row_bytes);
    const char* base = static_cast<const char*>(data_of(i));
    if (tensors_[i].kind == LayerKind::Flat) {
      if (s.rows) memory_->copy_to_host(out.data() + at, base, s.rows * s.row_bytes);
      continue;
    }
    // Ring: position p sits in slot p mod slots; at most two runs.
    const size_t slots = rows_of(i, capacity_);
    for (uint64_t done = 0; done < s.rows;) {
      const size_t slot = (s.first + done) % slots;
      const size_t run = std::min<size_t>(s.rows - done, slots - slot);
      memory_->copy_to_host(out.data() + at + done * s.row_bytes, base + slot * s.row_bytes, run * s.row_bytes);
      done += run;
    }
  }
  const std::vector<uint32_t> crcs = block_crc32(out.data(), out.size(), kCrcBlock);
  for (uint32_t c : crcs) put(&out, c);
  put(&out, uint32_t(crcs.size()));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return Status(Error::AccessFailed, "cannot write " + tmp);
    f.write(out.data(), std::streamsize(out.size()));
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      return Status(Error::AccessFailed, "cannot write " + tmp + " (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status(Error::AccessFailed, "cannot rename " + tmp + " to " + path);
  }
  return Status::ok_status();
}

Status KVStore::load_context(const std::string& path) {
  const std::lock_guard<std::mutex> held(access_);
  if (pending_ != 0 || length_ != 0)
    return Status(Error::InvalidState, "load a saved context into an empty store (reset it first); it holds " +
                                           std::to_string(length_) + " positions");
  if (exists_but_not_regular(path)) return bad_file(path, "not a regular file");
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return Status(Error::AccessFailed, "cannot open saved context " + path);
  const std::streamoff size = f.tellg();
  if (size < std::streamoff(sizeof(kMagic) + 4)) return bad_file(path, "not an offgraph-kv saved context");
  std::vector<char> data(static_cast<size_t>(size));
  f.seekg(0);
  if (!f.read(data.data(), size)) return Status(Error::AccessFailed, "cannot read saved context " + path);
  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) return bad_file(path, "not an offgraph-kv saved context");
  // The trailer: n block CRCs, then n. n must be exactly what the body before them needs.
  uint32_t blocks = 0;
  std::memcpy(&blocks, data.data() + data.size() - 4, 4);
  const size_t trailer = 4 + 4 * size_t(blocks);
  if (trailer > data.size() - sizeof(kMagic) || (data.size() - trailer + kCrcBlock - 1) / kCrcBlock != blocks)
    return bad_file(path, "truncated or corrupt (its block checksums do not fit its size)");
  const size_t body = data.size() - trailer;
  const std::vector<uint32_t> crcs = block_crc32(data.data(), body, kCrcBlock);
  if (std::memcmp(crcs.data(), data.data() + body, 4 * crcs.size()) != 0)
    return bad_file(path, "truncated or corrupt (a block's CRC-32 does not match)");
  Reader r(data.data() + sizeof(kMagic), body - sizeof(kMagic));
  uint32_t format = 0, id_len = 0, count = 0;
  uint64_t length = 0;
  if (!r.get(&format) || format != kFormat)
    return bad_file(path, "format " + std::to_string(format) + " is not " + std::to_string(kFormat));
  const char* id = r.get(&id_len) ? r.take(id_len) : nullptr;
  if (id == nullptr) return bad_file(path, "truncated header");
  if (std::string(id, id_len) != identity_)
    return bad_file(path, "saved by another program (other compiled code, layers, heads or dtype)");
  if (!r.get(&length) || !r.get(&count)) return bad_file(path, "truncated header");
  if (count != tensors_.size())
    return bad_file(path, std::to_string(count) + " tensors, this program has " + std::to_string(tensors_.size()));
  if (length > policy_.max_capacity)
    return bad_file(path, std::to_string(length) + " positions, beyond max_capacity " +
                              std::to_string(policy_.max_capacity));
  std::vector<Span> spans(count);
  for (size_t i = 0; i < count; ++i) {
    Span& s = spans[i];
    if (!r.get(&s.first) || !r.get(&s.rows) || !r.get(&s.row_bytes)) return bad_file(path, "truncated header");
    const TensorSpec& t = tensors_[i];
    const bool ring = t.kind == LayerKind::Ring;
    // first <= length before the sum: a crafted first past the length makes the u64 sum wrap to it.
    if (s.row_bytes != t.row_bytes() || s.first > length || s.first + s.rows != length || (!ring && s.first != 0))
      return bad_file(path, "tensor " + std::to_string(i) + " does not match this program's");
    // A ring must hold every position the next query's window reaches back to, as a live store does.
    const uint64_t needed = std::min<uint64_t>(length, t.window > 0 ? t.window - 1 : 0);
    if (ring && s.rows < needed)
      return bad_file(path, "tensor " + std::to_string(i) + " (ring layer " + std::to_string(t.layer) + ", window " +
                                std::to_string(t.window) + ") keeps " + std::to_string(s.rows) + " positions; " +
                                std::to_string(needed) + " are needed at length " + std::to_string(length));
    if (s.row_bytes != 0 && s.rows > std::numeric_limits<size_t>::max() / s.row_bytes)
      return bad_file(path, "tensor " + std::to_string(i) + " is larger than memory");
  }
  std::vector<const char*> rows(count);
  for (size_t i = 0; i < count; ++i)
    if ((rows[i] = r.take(spans[i].rows * spans[i].row_bytes)) == nullptr) return bad_file(path, "truncated rows");
  if (r.left() != 0) return bad_file(path, "trailing bytes");

  // Everything checked: make room (all-or-nothing), then copy in.
  const auto turn = control_turn();
  if (has_flat_ && length > capacity_) {
    Status s = resize_flat(next_capacity(policy_, capacity_, length), 0);
    if (!s.ok()) return s;
    ++growths_;
  }
  for (size_t i = 0; i < count; ++i) {
    Span s = spans[i];
    char* base = static_cast<char*>(data_of(i));
    if (tensors_[i].kind == LayerKind::Flat) {
      if (s.rows) memory_->copy_from_host(base, rows[i], s.rows * s.row_bytes);
      continue;
    }
    const size_t slots = rows_of(i, capacity_);
    const uint64_t skip = s.rows > slots ? s.rows - slots : 0;  // a smaller rewind budget here keeps fewer
    for (uint64_t done = skip; done < s.rows;) {
      const size_t slot = (s.first + done) % slots;
      const size_t run = std::min<size_t>(s.rows - done, slots - slot);
      memory_->copy_from_host(base + slot * s.row_bytes, rows[i] + done * s.row_bytes, run * s.row_bytes);
      done += run;
    }
    kept_from_[i] = s.first + skip;
  }
  length_ = length;
  return Status::ok_status();
}

}  // namespace offgraph_kv

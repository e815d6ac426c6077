// Files the app did not write: opened only when they are regular files (a FIFO
// would block forever, /dev/zero is read until memory runs out), with a size bound
// checked before a byte is read; artifact files are never reached through a symlink.
// Output: written to a fresh, randomly named sibling (O_EXCL: a planted file or
// symlink is never opened) and renamed over the destination.
#ifndef EDGE_APP_FILEIO_H_
#define EDGE_APP_FILEIO_H_

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace edge {

// A refusal about a file: its message is one line naming the file.
struct FileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string ByteSize(uint64_t n) {
  if (n >= (uint64_t{1} << 30) && n % (uint64_t{1} << 30) == 0) return std::to_string(n >> 30) + " GiB";
  if (n >= (uint64_t{1} << 20) && n % (uint64_t{1} << 20) == 0) return std::to_string(n >> 20) + " MiB";
  return std::to_string(n) + " bytes";
}

inline const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symlink";
  return "not a regular file";
}

// An open regular file and its size at open time.
class InFile {
 public:
  InFile() = default;
  InFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  InFile(InFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  InFile& operator=(InFile&& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(size_, o.size_);
    return *this;
  }
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;
  ~InFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }
  uint64_t size() const { return size_; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

  // Exactly n bytes at `offset`; false when the file ends first (it shrank).
  bool ReadAt(uint64_t offset, void* buf, size_t n) const {
    char* p = static_cast<char*>(buf);
    while (n > 0) {
      ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
      offset += static_cast<uint64_t>(got);
    }
    return true;
  }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Opens `path` (called `label` in messages) for reading if it is a regular file of at
// most max_bytes. follow_links=false refuses a symlink as the last path component.
// The type is checked before opening (opening a device can have effects) and again on
// the descriptor (the path may have been swapped in between); O_NONBLOCK keeps a FIFO
// swapped in between from blocking the open.
inline InFile OpenRegular(const std::string& path, const std::string& label, bool follow_links,
                          uint64_t max_bytes) {
  struct stat st;
  if ((follow_links ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) != 0) {
    if (errno == ENOENT) throw FileError(label + " is missing");
    throw FileError(label + ": cannot open (" + std::strerror(errno) + ")");
  }
  if (S_ISLNK(st.st_mode)) throw FileError(label + " is a symlink; refusing to follow it");
  if (!S_ISREG(st.st_mode)) throw FileError(label + " is not a regular file (" + FileKind(st.st_mode) + ")");
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow_links ? 0 : O_NOFOLLOW);
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    if (errno == ELOOP) throw FileError(label + " is a symlink; refusing to follow it");
    throw FileError(label + ": cannot open (" + std::strerror(errno) + ")");
  }
  InFile f(fd, 0);
  if (::fstat(fd, &st) != 0) throw FileError(label + ": cannot stat (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) throw FileError(label + " is not a regular file (" + FileKind(st.st_mode) + ")");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    throw FileError(label + " is larger than " + ByteSize(max_bytes) + " (" + std::to_string(size) + " bytes)");
  }
  return InFile(f.Release(), size);
}

// Reads a whole bounded regular file.
inline std::string ReadRegular(const std::string& path, const std::string& label, bool follow_links,
                               uint64_t max_bytes) {
  InFile f = OpenRegular(path, label, follow_links, max_bytes);
  std::string text(static_cast<size_t>(f.size()), '\0');
  if (!text.empty() && !f.ReadAt(0, &text[0], text.size())) throw FileError(label + " changed while being read");
  return text;
}

// What an interrupted app removes (main.cc's handler for SIGINT/SIGTERM/SIGHUP): the private
// copy of module.so until it is loaded, an output's temporary sibling until it is renamed.
// Fixed buffers and a flag per slot, because the handler may only call async-signal-safe
// functions (unlink, rmdir); a slot is disarmed before its buffer changes. The flag is a
// lock-free atomic (release/acquire): the handler may run on another thread (TVM's pool),
// which must see the whole path before it sees the flag.
enum DoomedSlot { kDoomedModule, kDoomedModuleDir, kDoomedOutput, kDoomedSlots };
struct Doomed {
  char path[4096];
  std::atomic<bool> armed{false};
};
static_assert(std::atomic<bool>::is_always_lock_free, "the interrupt handler reads it");
inline Doomed g_doomed[kDoomedSlots];

inline void Arm(DoomedSlot slot, const std::string& path) {
  Doomed& d = g_doomed[slot];
  d.armed.store(false, std::memory_order_release);
  if (path.size() >= sizeof(d.path)) return;  // too long to keep: not removed on an interrupt
  std::memcpy(d.path, path.c_str(), path.size() + 1);
  d.armed.store(true, std::memory_order_release);
}

inline void Disarm(DoomedSlot slot) { g_doomed[slot].armed.store(false, std::memory_order_release); }

// Async-signal-safe: files first, then the directory that held the module copy.
inline void RemoveDoomed() {
  auto armed = [](DoomedSlot s) { return g_doomed[s].armed.load(std::memory_order_acquire); };
  if (armed(kDoomedOutput)) ::unlink(g_doomed[kDoomedOutput].path);
  if (armed(kDoomedModule)) ::unlink(g_doomed[kDoomedModule].path);
  if (armed(kDoomedModuleDir)) ::rmdir(g_doomed[kDoomedModuleDir].path);
}

// Writes `head` then `body` to `path` atomically: a new file with a random name in the
// same directory, created with O_CREAT|O_EXCL|O_NOFOLLOW (a planted file or symlink of
// that name makes the open fail, never redirects the write), then renamed over `path`
// (which replaces a symlink at `path` itself rather than writing through it).
inline void WriteAtomic(const std::string& path, const std::string& head, const void* body, size_t body_size) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.empty()) throw FileError(path + ": cannot write (not a file name)");
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 16; ++attempt) {
    unsigned char rnd[8];
    if (::getrandom(rnd, sizeof(rnd), 0) != static_cast<ssize_t>(sizeof(rnd))) {
      throw FileError(path + ": cannot write (no randomness: " + std::strerror(errno) + ")");
    }
    char hex[17];
    for (int i = 0; i < 8; ++i) std::snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
    tmp = dir + "." + base + "." + hex + ".tmp";
    Arm(kDoomedOutput, tmp);  // before the open: a random name nobody else has until it is ours
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0) Disarm(kDoomedOutput);  // EEXIST: somebody else's file, never removed
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) throw FileError(path + ": cannot write (" + std::strerror(errno) + ")");
  auto write_all = [fd](const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t put = ::write(fd, p, n);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) return false;
      p += put;
      n -= static_cast<size_t>(put);
    }
    return true;
  };
  bool ok = write_all(head.data(), head.size()) && (body_size == 0 || write_all(body, body_size)) &&
            ::fsync(fd) == 0;
  int saved = errno;
  ok = (::close(fd) == 0) && ok;
  if (ok && ::rename(tmp.c_str(), path.c_str()) == 0) {
    Disarm(kDoomedOutput);
    return;
  }
  saved = ok ? errno : saved;
  ::unlink(tmp.c_str());
  Disarm(kDoomedOutput);
  throw FileError(path + ": cannot write (" + std::strerror(saved) + ")");
}

}  // namespace edge

#endif  // EDGE_APP_FILEIO_H_

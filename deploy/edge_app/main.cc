// edge_app: run a blockforge artifact (module.so + manifest.json) with the TVM
// runtime, without Python.
//
//   edge_app ARTIFACT_DIR --input NAME=FILE.npy [--input ...] --output OUT.npy [--repeat N]
//   edge_app ARTIFACT_DIR --input NAME=FILE.npy [--input ...] --decode N [--output OUT.npy]
//
// --decode N: N calls, each call's present outputs fed back as the next call's past inputs
// (the pairing in manifest.json, checked against the signature: decode.h); the tensors the
// module returned are passed straight back, so the cache never goes through a file or a
// host copy between steps. A model with logits and input_ids gets the argmax token as its
// next input_ids (attention_mask and position_ids grow). One line per call, with its latency.
// An artifact compiled with --kv-capacity C (manifest 'inplace') runs the steps after the
// prompt through decode_inplace: the prompt's cache is copied once into buffers of C rows,
// and each step writes only its new row there (no cache copy per token); --copy-cache runs
// the copying loop instead (A/B).
//
// Before module.so is loaded (loading runs its native code) the app checks that it
// matches its sha256 in manifest.json and that it is an ELF for this CPU, and that
// weights.bin (hashed too) has the size its table in the manifest says; inputs are
// checked against the manifest's signature. Exit codes: 0 ok, 2 refused (usage, bad
// artifact or inputs), 1 the runtime failed.
//
// Nothing it reads is trusted (the same rules as blockforge's Python loader,
// compile/artifact/manifest.py): manifest.json is size-bounded and type-checked (manifest.h);
// the files it lists are plain names of regular files, never symlinks, size-bounded and
// hashed through the descriptor that was checked; 'module' must be one of them. Inputs
// are regular files whose shapes must agree with the manifest (static dims equal,
// symbolic dims in [1, kMaxSymbolicDim], at most kMaxInputBytes) before their data is
// read (npy.h). The output is written to a fresh temporary file, then renamed.
//
// In a package (deploy/package.py) the app also checks bin/ and lib/ against the
// manifest's 'package_files' before module.so is loaded (VerifyPackage). It cannot check
// its own runtime libraries before they load: the dynamic loader maps lib/libtvm_*.so
// (and runs their constructors) before main. So run.sh checks their sha256 first, where
// the device has sha256sum; the app then refuses a package whose bin/ or lib/ differs
// from its manifest, and, when it is the package's own bin/edge_app, runtime libraries
// that are not the package's verified lib/ files (e.g. taken from LD_LIBRARY_PATH).
#include <dirent.h>
#include <dlpack/dlpack.h>
#include <link.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "decode.h"
#include "fileio.h"
#include "json.h"
#include "manifest.h"
#include "npy.h"
#include "sha256.h"

namespace ffi = tvm::ffi;

namespace {

#if defined(__x86_64__)
constexpr const char* kArch = "x86_64";
constexpr uint16_t kMachine = 62;  // EM_X86_64
#elif defined(__aarch64__)
constexpr const char* kArch = "aarch64";
constexpr uint16_t kMachine = 183;  // EM_AARCH64
#else
#error "edge_app is built for x86_64 or aarch64"
#endif

// tvm::runtime::memory::AllocatorType::kPooled (what relax.VirtualMachine uses by default).
constexpr int kPooledAllocator = 2;

// Input bounds, the same as blockforge's Python side (graph/model_io.py): a symbolic dim
// is at most MAX_BOUND_DIM (what --shape accepts), an input at most MAX_INPUT_BYTES.
constexpr int64_t kMaxSymbolicDim = 65536;
constexpr uint64_t kMaxInputBytes = uint64_t{2} << 30;

const char* kUsage =
    "usage: edge_app ARTIFACT_DIR --input NAME=FILE.npy [--input ...] --output OUT.npy "
    "[--repeat N] | --decode N [--copy-cache] [--output OUT.npy]";

// An error with the exit code it ends the program with; `usage` adds the usage line.
struct Failure {
  int code;
  std::string message;
  bool usage = false;
};

[[noreturn]] void Refuse(const std::string& msg) { throw Failure{2, msg}; }
[[noreturn]] void RefuseUsage(const std::string& msg) { throw Failure{2, msg, true}; }
[[noreturn]] void Fail(const std::string& msg) { throw Failure{1, msg}; }

// Messages quote names from files the app did not write: control bytes are escaped so
// that a refusal stays one line.
std::string OneLine(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char esc[5];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

std::string ShapeStr(const std::vector<std::string>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    s += dims[i];
    if (dims.size() == 1 || i + 1 < dims.size()) s += ",";
    if (i + 1 < dims.size()) s += " ";
  }
  return s + ")";
}

std::string ShapeStr(const std::vector<int64_t>& dims) {
  std::vector<std::string> s;
  for (int64_t d : dims) s.push_back(std::to_string(d));
  return ShapeStr(s);
}

// The last non-empty line of a (possibly multi-line, backtrace-laden) message.
std::string LastLine(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  }
  size_t start = last.find_first_not_of(" \t");
  last = start == std::string::npos ? "" : last.substr(start);
  return last.size() > 300 ? last.substr(0, 300) + "..." : last;
}

struct Options {
  std::string artifact;
  std::vector<std::pair<std::string, std::string>> inputs;  // name, path
  std::string output;
  int repeat = 1;
  int decode = 0;  // 0: one call (with --repeat)
  bool copy_cache = false;  // --decode on an 'inplace' artifact: the copying loop anyway
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  auto value = [&](int& i, const std::string& flag) -> std::string {
    std::string a = argv[i];
    if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) {
      return a.substr(flag.size() + 1);
    }
    if (i + 1 >= argc) RefuseUsage(flag + " needs a value");
    return argv[++i];
  };
  auto is = [](const std::string& a, const std::string& flag) {
    return a == flag || a.compare(0, flag.size() + 1, flag + "=") == 0;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("%s\n", kUsage);
      std::exit(0);
    } else if (is(a, "--input")) {
      std::string v = value(i, "--input");
      size_t eq = v.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == v.size()) {
        Refuse("--input takes NAME=FILE.npy, got '" + v + "'");
      }
      o.inputs.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    } else if (is(a, "--output")) {
      o.output = value(i, "--output");
    } else if (is(a, "--repeat")) {
      std::string v = value(i, "--repeat");
      char* end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1 || n > 1000000) {
        Refuse("--repeat takes a positive integer, got '" + v + "'");
      }
      o.repeat = static_cast<int>(n);
    } else if (is(a, "--decode")) {
      std::string v = value(i, "--decode");
      char* end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1 || n > kMaxSymbolicDim) {
        Refuse("--decode takes an integer in [1, " + std::to_string(kMaxSymbolicDim) + "], got '" + v + "'");
      }
      o.decode = static_cast<int>(n);
    } else if (a == "--copy-cache") {
      o.copy_cache = true;
    } else if (!a.empty() && a[0] == '-') {
      RefuseUsage("unknown option " + a);
    } else if (o.artifact.empty()) {
      o.artifact = a;
    } else {
      RefuseUsage("unexpected argument '" + a + "'");
    }
  }
  if (o.artifact.empty()) RefuseUsage("no artifact directory given");
  if (o.output.empty() && !o.decode) RefuseUsage("--output OUT.npy is required");
  if (o.copy_cache && !o.decode) RefuseUsage("--copy-cache is a --decode option");
  return o;
}

edge::Manifest ReadManifest(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) Refuse(dir + ": not an artifact directory");
  const std::string path = dir + "/manifest.json";
  if (lstat(path.c_str(), &st) != 0 && errno == ENOENT) {
    Refuse(dir + ": no manifest.json (not a blockforge artifact)");
  }
  try {
    return edge::ParseManifest(
        edge::ReadRegular(path, "manifest.json", /*follow_links=*/false, edge::kMaxManifestBytes));
  } catch (const edge::FileError& e) {
    Refuse(dir + ": " + e.what());
  } catch (const edge::ManifestError& e) {
    Refuse(path + ": " + e.what());
  }
}

void RefuseTampered(const std::string& dir, const std::string& name) {
  Refuse(dir + ": " + name + " does not match its sha256 in manifest.json (tampered or corrupted); "
         "refusing to load it");
}

// Every file the manifest lists must match its sha256. Opened without following links,
// checked to be a bounded regular file, hashed through that descriptor. module.so and
// weights.bin are hashed where they are read instead (CopyModule, ReadWeights), over the very
// bytes used: a file rewritten between a check here and a later open would otherwise pass.
void VerifyFiles(const std::string& dir, const edge::Manifest& m) {
  for (const auto& [name, digest] : m.files) {
    if (name == m.module || (m.has_weights && name == m.weights_file)) continue;
    std::string got;
    try {
      edge::InFile f = edge::OpenRegular(dir + "/" + name, name, /*follow_links=*/false,
                                         edge::kMaxArtifactFileBytes);
      if (!edge::Sha256Fd(f.fd(), f.size(), &got)) Refuse(dir + ": " + name + " changed while being read");
    } catch (const edge::FileError& e) {
      Refuse(dir + ": " + e.what());
    }
    if (got != digest) RefuseTampered(dir, name);
  }
}

// The private copy of module.so that is dlopened (Python: compile/artifact/runtime.py does the
// same): a 0700 directory under $TMPDIR (else /tmp), removed as soon as the library is loaded
// (the mapping stays), on every error and on SIGINT/SIGTERM/SIGHUP. Removed only at exit, as
// before, a run killed later left it behind: the aarch64 tests whose module stops on SIGILL
// left two edge_app-*/module.so in /tmp per CI run (24 there after a day of runs).
struct PrivateModule {
  std::string dir, path;
  PrivateModule() = default;
  PrivateModule(const PrivateModule&) = delete;
  PrivateModule& operator=(const PrivateModule&) = delete;
  ~PrivateModule() { Remove(); }
  void Remove() {
    if (!path.empty()) ::unlink(path.c_str());
    if (!dir.empty()) ::rmdir(dir.c_str());
    edge::Disarm(edge::kDoomedModule);
    edge::Disarm(edge::kDoomedModuleDir);
    path.clear();
    dir.clear();
  }
};

// Copies module.so into `pm`, hashing the bytes as they are written; refused unless they are
// exactly the bytes manifest.json's sha256 names.
void CopyModule(const std::string& dir, const edge::Manifest& m, PrivateModule* pm) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/edge_app-XXXXXX";
  if (!::mkdtemp(&templ[0])) Refuse("cannot create a private directory for module.so (" + templ + "): " + std::strerror(errno));
  edge::Arm(edge::kDoomedModuleDir, templ);  // (an interrupt just before this leaves one empty directory)
  pm->dir = templ;
  edge::InFile f;
  try {
    f = edge::OpenRegular(dir + "/" + m.module, m.module, /*follow_links=*/false, edge::kMaxArtifactFileBytes);
  } catch (const edge::FileError& e) {
    Refuse(dir + ": " + e.what());
  }
  const std::string path = pm->dir + "/module.so";
  edge::Arm(edge::kDoomedModule, path);  // in our fresh 0700 directory: nobody else's
  int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0700);
  if (out < 0) Refuse("cannot write " + path + ": " + std::strerror(errno));
  pm->path = path;
  bool written = true;
  std::string got;
  const bool ok = edge::Sha256Fd(f.fd(), f.size(), &got, [&](const char* p, size_t n) {
    for (size_t done = 0; done < n;) {
      ssize_t w = ::write(out, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return written = false;
      done += static_cast<size_t>(w);
    }
    return true;
  });
  written = (::close(out) == 0) && written;
  if (!written) Refuse("cannot write " + path + ": " + std::strerror(errno));
  if (!ok) Refuse(dir + ": " + m.module + " changed while being read");
  if (got != m.files.at(m.module)) RefuseTampered(dir, m.module);
}

std::string MachineName(uint16_t m) {
  switch (m) {
    case 62: return "x86_64";
    case 183: return "aarch64";
    case 3: return "x86 (32-bit)";
    case 40: return "arm (32-bit)";
    case 243: return "riscv";
    default: return "ELF machine " + std::to_string(m);
  }
}

uint64_t LoadLE(const std::string& b, size_t off, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[off + i]);
  return v;
}

// The ELF header says which CPU module.so is for; its program headers must lie within
// the file (dlopen of a truncated library can crash instead of failing).
void CheckElf(const std::string& path, const std::string& module) {
  std::string b(64, '\0');
  edge::InFile f;
  try {
    f = edge::OpenRegular(path, module, /*follow_links=*/false, edge::kMaxArtifactFileBytes);
  } catch (const edge::FileError& e) {
    Refuse(e.what());
  }
  if (f.size() < 64 || !f.ReadAt(0, &b[0], 64) || b.compare(0, 4, "\x7f" "ELF") != 0) {
    Refuse(module + " is not an ELF shared library");
  }
  const uint64_t size = f.size(), phoff = LoadLE(b, 32, 8), phentsize = LoadLE(b, 54, 2),
                 phnum = LoadLE(b, 56, 2);
  std::string ph;
  bool ok = b[4] == 2 && phentsize >= 56 && phoff <= size && phnum * phentsize <= size - phoff;
  if (ok) {
    ph.resize(static_cast<size_t>(phnum * phentsize));
    ok = ph.empty() || f.ReadAt(phoff, &ph[0], ph.size());
  }
  if (b[5] != 1) Refuse(module + " is big-endian, this is " + kArch);
  uint16_t machine = static_cast<uint16_t>(LoadLE(b, 18, 2));
  if (machine != kMachine) Refuse(module + " is for " + MachineName(machine) + ", this is " + kArch);
  if (b[4] != 2) Refuse(module + " is a 32-bit ELF, this is " + kArch);
  if (LoadLE(b, 16, 2) != 3) {
    Refuse(module + " is not a shared library (ELF type " + std::to_string(LoadLE(b, 16, 2)) + ")");
  }
  for (uint64_t i = 0; ok && i < phnum; ++i) {
    size_t at = static_cast<size_t>(i * phentsize);
    uint64_t offset = LoadLE(ph, at + 8, 8), filesz = LoadLE(ph, at + 32, 8);
    ok = offset <= size && filesz <= size - offset;
  }
  if (!ok) Refuse(module + " is truncated or corrupt (its ELF segments reach past the end of the file)");
}

// A package's bin/ and lib/, in the Python loader's order (compile/artifact/manifest.py,
// verify_package): both real directories (a symlinked lib/ would reach outside), every
// entry listed in 'package_files' (the rpath searches lib/ before the system: an unlisted
// libstdc++.so.6 there would be loaded), each listed file a regular file with its sha256
// and an ELF for this CPU. An artifact without bin/, lib/ and 'package_files' passes.
void VerifyPackage(const std::string& dir, const edge::Manifest& m) {
  std::vector<std::string> present;
  for (const char* d : {"bin", "lib"}) {
    struct stat st;
    const std::string p = dir + "/" + d;
    if (lstat(p.c_str(), &st) != 0) {
      if (errno == ENOENT) continue;
      Refuse(dir + ": " + d + ": cannot open (" + std::strerror(errno) + ")");
    }
    if (S_ISLNK(st.st_mode)) Refuse(dir + ": " + d + "/ is a symlink; refusing to follow it");
    if (!S_ISDIR(st.st_mode)) Refuse(dir + ": " + d + " is not a directory");
    present.push_back(d);
  }
  if (!m.has_package_files) {
    if (!present.empty()) {
      Refuse(dir + ": " + present[0] + "/ is there but manifest.json lacks 'package_files' (a package lists "
             "what it ships in bin/ and lib/)");
    }
    return;
  }
  std::set<std::string> entries;
  for (const std::string& d : present) {
    DIR* dp = opendir((dir + "/" + d).c_str());
    if (!dp) Refuse(dir + ": " + d + "/: cannot list (" + std::strerror(errno) + ")");
    while (const dirent* e = readdir(dp)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") entries.insert(d + "/" + name);
    }
    closedir(dp);
  }
  for (const std::string& rel : entries) {
    if (!m.package_files.count(rel)) {
      Refuse(dir + ": " + rel + " is not listed in manifest.json's 'package_files'; refusing a package with "
             "unlisted files in bin/ or lib/");
    }
  }
  for (const auto& [rel, digest] : m.package_files) {
    std::string got, head(20, '\0');
    bool elf = false;
    try {
      edge::InFile f = edge::OpenRegular(dir + "/" + rel, rel, /*follow_links=*/false, edge::kMaxArtifactFileBytes);
      if (!edge::Sha256Fd(f.fd(), f.size(), &got)) Refuse(dir + ": " + rel + " changed while being read");
      elf = f.size() >= 20 && f.ReadAt(0, &head[0], 20) && head.compare(0, 4, "\x7f" "ELF") == 0;
    } catch (const edge::FileError& e) {
      Refuse(dir + ": " + e.what());
    }
    if (got != digest) {
      Refuse(dir + ": " + rel + " does not match its sha256 in manifest.json (tampered or corrupted); "
             "refusing to load it");
    }
    if (!elf) Refuse(dir + ": " + rel + " is not an ELF file; refusing to load it");
    const uint16_t machine = static_cast<uint16_t>(LoadLE(head, 18, 2));
    if (machine != kMachine) Refuse(dir + ": " + rel + " is for " + MachineName(machine) + ", this is " + kArch);
  }
}

// weights.bin (compile/artifact/weights.py): its table was checked with the manifest (offsets
// aligned, in order, inside 'bytes'); the file must have exactly 'bytes' (it was hashed by
// VerifyFiles). Opened here, before module.so is loaded; read by ReadWeights.
edge::InFile OpenWeights(const std::string& dir, const edge::Manifest& m) {
  if (!m.has_weights) return edge::InFile();
  edge::InFile f;
  try {
    f = edge::OpenRegular(dir + "/" + m.weights_file, m.weights_file, /*follow_links=*/false,
                          edge::kMaxArtifactFileBytes);
  } catch (const edge::FileError& e) {
    Refuse(dir + ": " + e.what());
  }
  if (f.size() != m.weights_bytes) {
    Refuse(dir + ": " + m.weights_file + " is " + std::to_string(f.size()) + " bytes, manifest.json's 'weights' says " +
           std::to_string(m.weights_bytes) + " (truncated or replaced)");
  }
  return f;
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return stat(a.c_str(), &sa) == 0 && stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// When this process is the package's own bin/edge_app, the TVM runtime it loaded must be
// the package's lib/ files that VerifyPackage hashed, not libraries found elsewhere.
void CheckLoadedRuntime(const std::string& dir, const edge::Manifest& m) {
  if (!m.has_package_files || !SameFile("/proc/self/exe", dir + "/bin/edge_app")) return;
  std::vector<std::string> loaded;
  dl_iterate_phdr([](dl_phdr_info* info, size_t, void* data) {
    if (info->dlpi_name && *info->dlpi_name) static_cast<std::vector<std::string>*>(data)->push_back(info->dlpi_name);
    return 0;
  }, &loaded);
  for (const std::string& path : loaded) {
    const std::string base = path.substr(path.rfind('/') + 1);
    if (base != "libtvm_runtime.so" && base != "libtvm_ffi.so") continue;
    if (!m.package_files.count("lib/" + base) || !SameFile(path, dir + "/lib/" + base)) {
      Refuse("the TVM runtime was loaded from " + path + ", not the package's lib/" + base +
             " (LD_LIBRARY_PATH?); refusing to run");
    }
  }
}

void CheckTarget(const edge::Manifest& m) {
  if (m.has_arch && m.arch != kArch) {
    Refuse("artifact is built for " + m.arch + " (manifest target.arch), this is " + kArch);
  }
  if (m.has_device && m.device != "cpu") {
    Refuse("artifact targets device '" + m.device + "'; edge_app runs CPU artifacts only");
  }
  if (m.device_null) Refuse("artifact is build-only (no device to run on)");
}

struct AlignedCPUAlloc {
  void AllocData(DLTensor* t) {
    size_t n = std::max<size_t>(ffi::GetDataSize(*t), 1);
    void* p = nullptr;
    if (posix_memalign(&p, 64, n) != 0) throw std::bad_alloc();
    t->data = p;
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

// The weights as main's trailing arguments: weights.bin read once, byte for byte, into one
// anonymous mapping whose tensors view it at their offsets (the file's layout), passed by
// reference to every call (a decode step copies nothing of them). The mapping starts on a 2 MiB
// boundary and is advised MADV_HUGEPAGE: a decode step streams every weight once per token, and
// with 4 KiB pages it pays a page walk every 4 KiB and the prefetchers stop at each boundary (the
// Python runtime's arena, compile/artifact/weights.py: its step 0.92-0.94x the plain copies';
// where THP is off the advice does nothing). The file's sha256 is taken over those bytes, not in
// an earlier pass, before any call of the module.
struct WeightArena {
  static constexpr size_t kHugePage = size_t{2} << 20;
  void* map = MAP_FAILED;
  size_t map_len = 0;
  char* base = nullptr;
  explicit WeightArena(size_t n) : map_len(n + 2 * kHugePage) {
    map = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) throw std::bad_alloc();
    uintptr_t p = reinterpret_cast<uintptr_t>(map);
    base = reinterpret_cast<char*>((p + kHugePage - 1) / kHugePage * kHugePage);
#ifdef MADV_HUGEPAGE
    ::madvise(base, (n + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);  // no THP: plain pages
#endif
  }
  ~WeightArena() { ::munmap(map, map_len); }
  WeightArena(const WeightArena&) = delete;
  WeightArena& operator=(const WeightArena&) = delete;
};

// FromNDAlloc's allocator for a tensor that is a slice of the arena: nothing allocated or freed;
// each tensor holds the arena, so the mapping lives as long as the last of them.
struct ArenaSlice {
  std::shared_ptr<WeightArena> arena;
  uint64_t offset;
  void AllocData(DLTensor* t) { t->data = arena->base + offset; }
  void FreeData(DLTensor*) {}
};

std::vector<ffi::Tensor> ReadWeights(const std::string& dir, const edge::InFile& f, const edge::Manifest& m,
                                     DLDevice cpu) {
  std::vector<ffi::Tensor> out;
  if (!m.has_weights) return out;
  const size_t size = static_cast<size_t>(f.size());  // == the table's `bytes` (OpenWeights)
  auto arena = std::make_shared<WeightArena>(size);
  if (size && !f.ReadAt(0, arena->base, size)) Refuse(m.weights_file + " changed while being read");
  char extra;
  if (::pread(f.fd(), &extra, 1, static_cast<off_t>(f.size())) != 0) Refuse(m.weights_file + " changed while being read");
  edge::Sha256 h;
  h.Update(arena->base, size);
  if (h.HexDigest() != m.files.at(m.weights_file)) RefuseTampered(dir, m.weights_file);
  for (const edge::WeightTensor& w : m.weights) {  // offsets and sizes checked inside `bytes` (manifest.h)
    ffi::Tensor t = ffi::Tensor::FromNDAlloc(ArenaSlice{arena, w.offset}, ffi::Shape(w.shape),
                                             ffi::StringToDLDataType(w.dtype), cpu);
    if (ffi::GetDataSize(*t.GetDLTensorPtr()) != w.nbytes) Fail("weight " + w.name + ": size mismatch for " + w.dtype);
    out.push_back(std::move(t));
  }
  return out;
}

// Loads and checks the inputs against the signature, in manifest order. Each file's
// header is checked against the manifest before its data is read: the rank, static dims
// equal, symbolic dims in [1, kMaxSymbolicDim] and equal wherever the symbol recurs, at
// most kMaxInputBytes (the header parser has already checked that the data is exactly
// as long as the shape says, with overflow-checked arithmetic).
// may_be_empty: (input, axis) that may be 0: a decode loop's empty cache (P = 0).
std::vector<edge::NpyArray> LoadInputs(const Options& o, const std::vector<edge::TensorSig>& sigs,
                                       const std::set<std::pair<std::string, size_t>>& may_be_empty = {}) {
  using edge::TensorSig;
  std::map<std::string, std::string> given;
  for (const auto& [name, path] : o.inputs) {
    if (given.count(name)) Refuse("input '" + name + "' given twice");
    bool known = false;
    for (const auto& s : sigs) known = known || s.name == name;
    if (!known) {
      std::string names;
      for (const auto& s : sigs) names += (names.empty() ? "" : ", ") + s.name;
      Refuse("unknown input '" + name + "' (the model takes: " + names + ")");
    }
    given[name] = path;
  }
  std::vector<edge::NpyArray> arrays;
  std::map<std::string, std::pair<int64_t, std::string>> bound;  // symbol -> (value, input)
  for (const auto& s : sigs) {
    auto it = given.find(s.name);
    if (it == given.end()) Refuse("missing input '" + s.name + "' (give --input " + s.name + "=FILE.npy)");
    const std::string& path = it->second;
    const std::string what = "input '" + s.name + "': ";
    try {
      edge::NpyFile file(path, kMaxInputBytes + 12 + edge::kMaxNpyHeaderBytes);
      const edge::NpyHeader& h = file.header();
      if (h.dtype != s.dtype) {
        Refuse(what + path + " has dtype " + h.dtype + ", the model takes " + s.dtype);
      }
      bool ok = h.shape.size() == s.fixed.size();
      for (size_t i = 0; ok && i < s.fixed.size(); ++i) {
        const int64_t got = h.shape[i];
        if (s.fixed[i] >= 0) {
          ok = got == s.fixed[i];
          continue;
        }
        const bool empty_ok = got == 0 && may_be_empty.count({s.name, i});
        if ((got < 1 && !empty_ok) || got > kMaxSymbolicDim) {
          Refuse(what + "dim '" + s.dims[i] + "' is " + std::to_string(got) + ", outside [1, " +
                 std::to_string(kMaxSymbolicDim) + "]");
        }
        if (s.fixed[i] == TensorSig::kAnonymous) continue;
        auto b = bound.find(s.dims[i]);
        if (b == bound.end()) {
          bound[s.dims[i]] = {got, s.name};
        } else if (b->second.first != got) {
          Refuse(what + "dim '" + s.dims[i] + "' is " + std::to_string(got) + " here but " +
                 std::to_string(b->second.first) + " in '" + b->second.second + "'");
        }
      }
      if (!ok) {
        Refuse(what + "shape " + ShapeStr(h.shape) + " does not match the model's " + ShapeStr(s.dims));
      }
      if (h.nbytes > kMaxInputBytes) {
        Refuse(what + path + " holds " + std::to_string(h.nbytes) + " bytes, more than the " +
               edge::ByteSize(kMaxInputBytes) + " an input may have");
      }
      arrays.push_back(file.Read());
    } catch (const std::runtime_error& e) {  // edge::FileError, edge::NpyError
      Refuse(what + e.what());
    }
  }
  return arrays;
}

void SetThreadsFromCpus() {
  if (std::getenv("TVM_NUM_THREADS")) return;
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 1) n = 1;
  // Without it TVM's pool halves hardware_concurrency on x86 (often to 1 on VMs).
  setenv("TVM_NUM_THREADS", std::to_string(n).c_str(), 0);
}

ffi::Tensor FirstTensor(const ffi::Any& rv, size_t* count) {
  if (auto t = rv.as<ffi::Tensor>()) {
    *count = 1;
    return *t;
  }
  if (auto arr = rv.as<ffi::Array<ffi::Any>>()) {
    *count = arr->size();
    if (arr->size() >= 1) {
      if (auto t = (*arr)[0].as<ffi::Tensor>()) return *t;
    }
  }
  Fail("main returned " + std::string(rv.GetTypeKey()) + ", not a tensor");
}

// The integer tensors a token feed reads and writes (input_ids, attention_mask, position_ids).
int64_t IntAt(const DLTensor* t, int64_t i) {
  const char* d = static_cast<const char*>(t->data) + t->byte_offset;
  return t->dtype.bits == 64 ? reinterpret_cast<const int64_t*>(d)[i] : reinterpret_cast<const int32_t*>(d)[i];
}

void SetInt(ffi::Tensor& t, int64_t i, int64_t v) {  // t: a fresh tensor of ours (byte_offset 0)
  void* d = t.data_ptr();
  if (t.GetDLTensorPtr()->dtype.bits == 64) {
    reinterpret_cast<int64_t*>(d)[i] = v;
  } else {
    reinterpret_cast<int32_t*>(d)[i] = static_cast<int32_t>(v);
  }
}

void CheckIntTensor(const ffi::Tensor& t, const std::string& name, int rank) {
  const DLTensor* dl = t.GetDLTensorPtr();
  if (dl->dtype.code != kDLInt || (dl->dtype.bits != 32 && dl->dtype.bits != 64) || dl->dtype.lanes != 1 ||
      dl->ndim != rank || !t.IsContiguous()) {
    Refuse("--decode: " + name + " must be an int32 or int64 tensor of rank " + std::to_string(rank));
  }
}

// Greedy: the argmax of logits[b, -1, :] becomes input_ids (B, 1); attention_mask gets a
// column of ones, position_ids the next position. Returns the tokens.
std::vector<int64_t> FeedTokens(const edge::TokenFeed& feed, const std::vector<ffi::Tensor>& outs,
                                const edge::Manifest& m, std::vector<ffi::Tensor>& args, DLDevice cpu) {
  auto in_index = [&](const std::string& n) {
    const long i = edge::InputIndex(m, n);
    if (i < 0) Fail("no input " + n);
    return static_cast<size_t>(i);
  };
  size_t lo = 0;
  for (size_t i = 0; i < m.outputs.size(); ++i)
    if (m.outputs[i].name == feed.logits) lo = i;
  const DLTensor* lg = outs[lo].GetDLTensorPtr();
  if (lg->ndim != 3 || lg->dtype.code != kDLFloat || lg->dtype.bits != 32 || !outs[lo].IsContiguous()) {
    Fail("--decode: logits must be a contiguous float32 (batch, seq, vocab) tensor");
  }
  const int64_t b = lg->shape[0], sq = lg->shape[1], v = lg->shape[2];
  const float* data = reinterpret_cast<const float*>(static_cast<const char*>(lg->data) + lg->byte_offset);
  std::vector<int64_t> tok(b);
  for (int64_t r = 0; r < b; ++r) {
    const float* row = data + (r * sq + sq - 1) * v;
    tok[r] = std::max_element(row, row + v) - row;  // the first of equal maxima, as numpy's argmax
  }
  auto fresh = [&](size_t idx, std::vector<int64_t> shape) {
    return ffi::Tensor::FromNDAlloc(AlignedCPUAlloc(), ffi::Shape(shape), args[idx].GetDLTensorPtr()->dtype, cpu);
  };
  size_t ii = in_index(feed.input_ids);
  CheckIntTensor(args[ii], feed.input_ids, 2);
  ffi::Tensor ids = fresh(ii, {b, 1});
  for (int64_t r = 0; r < b; ++r) SetInt(ids, r, tok[r]);
  args[ii] = ids;
  if (!feed.attention_mask.empty()) {
    size_t mi = in_index(feed.attention_mask);
    CheckIntTensor(args[mi], feed.attention_mask, 2);
    const DLTensor* old = args[mi].GetDLTensorPtr();
    const int64_t t = old->shape[1];
    ffi::Tensor mask = fresh(mi, {old->shape[0], t + 1});
    for (int64_t r = 0; r < old->shape[0]; ++r) {
      for (int64_t j = 0; j < t; ++j) SetInt(mask, r * (t + 1) + j, IntAt(old, r * t + j));
      SetInt(mask, r * (t + 1) + t, 1);
    }
    args[mi] = mask;
  }
  if (!feed.position_ids.empty()) {
    size_t pi = in_index(feed.position_ids);
    CheckIntTensor(args[pi], feed.position_ids, 2);
    const DLTensor* old = args[pi].GetDLTensorPtr();
    const int64_t rows = old->shape[0], cols = old->shape[1];
    ffi::Tensor pos = fresh(pi, {rows, 1});
    for (int64_t r = 0; r < rows; ++r) SetInt(pos, r, IntAt(old, r * cols + cols - 1) + 1);
    args[pi] = pos;
  }
  return tok;
}

// --decode N: the module's present tensors go straight back in as the next pasts.
// A decoder's attention mask spans the cache and the new positions: (batch, past + seq). Dynamo
// exports tie its length to nothing the module checks, so a prompt whose mask is not past + seq
// long would run; refused before the first call, in the Python loop's words
// (compile/decode/inputs.py check_mask_length).
void CheckMaskLength(const edge::Manifest& m, const edge::Pairing& p, const std::vector<ffi::Tensor>& args) {
  if (!p.tokens.on || p.tokens.attention_mask.empty()) return;
  const long mi = edge::InputIndex(m, p.tokens.attention_mask), ii = edge::InputIndex(m, p.tokens.input_ids);
  const edge::CachePair& first = p.pairs[0];
  if (mi < 0 || ii < 0) return;
  const DLTensor* mask = args[mi].GetDLTensorPtr();
  const DLTensor* ids = args[ii].GetDLTensorPtr();
  const DLTensor* past = args[first.in_index].GetDLTensorPtr();
  if (mask->ndim != 2 || ids->ndim != 2 || past->ndim <= first.axis) return;  // the signature check's
  const int64_t len = mask->shape[1], seq = ids->shape[1], cached = past->shape[first.axis];
  if (len == cached + seq) return;
  Refuse("--input: " + p.tokens.attention_mask + " has length " + std::to_string(len) +
         ", but a decoder's mask spans the cache and the new positions: past + seq = " + std::to_string(cached) +
         " + " + std::to_string(seq) + " = " + std::to_string(cached + seq) + " (" + first.past + " axis " +
         std::to_string(first.axis) + ", " + p.tokens.input_ids + " axis 1)");
}

// The decode step's own entry (manifest 'step', compile/decode/entries.py): the function a
// call runs whose input binding the step's dim to 1 has that length, else main.
struct Entries {
  ffi::Function main_fn, step_fn;  // (Optional's operator* returns a copy: a reference to it would dangle)
  size_t step_input = 0;
  int step_axis = -1;  // -1: no step entry
  ffi::Function inplace_fn;  // manifest 'inplace': decode_inplace (has_inplace)
  bool has_inplace = false;

  const ffi::Function& For(const std::vector<ffi::Tensor>& args) const {
    if (step_axis >= 0 && args[step_input].GetDLTensorPtr()->shape[step_axis] == 1) return step_fn;
    return main_fn;
  }
};

// A buffer of `capacity` rows along `axis` holding `present` in its first rows (the rest
// zero): the cache decode_inplace extends in place (compile/decode/loop.py _capacity_buffer).
ffi::Tensor CapacityBuffer(const ffi::Tensor& present, int axis, int64_t capacity, DLDevice cpu) {
  const DLTensor* q = present.GetDLTensorPtr();
  std::vector<int64_t> shape(q->shape, q->shape + q->ndim);
  const int64_t filled = shape[axis];
  shape[axis] = capacity;
  ffi::Tensor buf = ffi::Tensor::FromNDAlloc(AlignedCPUAlloc(), ffi::Shape(shape), q->dtype, cpu);
  std::memset(buf.data_ptr(), 0, ffi::GetDataSize(*buf.GetDLTensorPtr()));
  int64_t outer = 1, inner = (q->dtype.bits * q->dtype.lanes + 7) / 8;
  for (int d = 0; d < axis; ++d) outer *= shape[d];
  for (int d = axis + 1; d < q->ndim; ++d) inner *= shape[d];
  const char* src = static_cast<const char*>(q->data) + q->byte_offset;
  char* dst = static_cast<char*>(buf.data_ptr());
  for (int64_t b = 0; b < outer; ++b) {
    std::memcpy(dst + b * capacity * inner, src + b * filled * inner, static_cast<size_t>(filled * inner));
  }
  return buf;
}

int DecodeLoop(const Options& o, const edge::Manifest& m, const edge::Pairing& p, const Entries& entries,
               std::vector<ffi::Tensor> args, DLDevice cpu) {
  const edge::CachePair& first = p.pairs[0];
  CheckMaskLength(m, p, args);
  // The in-place plan (compile/decode/loop.py _inplace_plan): an 'inplace' artifact, a language
  // model (one token per step) whose first output is not a cache, at least one step after the
  // prompt; a loop that would outgrow the capacity is refused before it runs.
  bool inplace = entries.has_inplace && !o.copy_cache && entries.step_axis >= 0 && p.tokens.on && o.decode >= 2;
  for (const auto& c : p.pairs) inplace = inplace && c.out_index != 0;
  if (inplace) {
    const long ii = edge::InputIndex(m, p.tokens.input_ids);
    const int64_t seq = ii >= 0 && args[ii].GetDLTensorPtr()->ndim == 2 ? args[ii].GetDLTensorPtr()->shape[1] : -1;
    const int64_t final_len = args[first.in_index].GetDLTensorPtr()->shape[first.axis] + seq + o.decode - 1;
    if (seq < 1 || final_len > m.inplace_capacity) {
      Refuse("--decode " + std::to_string(o.decode) + " would fill " + std::to_string(final_len) +
             " positions of the cache, past the artifact's in-place capacity of " +
             std::to_string(m.inplace_capacity) + " (compile --kv-capacity): fewer steps, a larger capacity, or "
             "--copy-cache");
    }
  }
  const size_t n_in = m.inputs.size();
  std::vector<ffi::Tensor> caps;  // per pair, from the first step after the prompt on
  int64_t filled = 0;  // the capacity buffers' rows in use
  std::vector<double> step_ms, call_ms;
  std::vector<std::vector<int64_t>> tokens;
  std::vector<ffi::Tensor> outs;
  int main_calls = 0, step_calls = 0, inplace_calls = 0;
  for (int step = 0; step < o.decode; ++step) {
    const int64_t past = caps.empty() ? args[first.in_index].GetDLTensorPtr()->shape[first.axis] : filled;
    std::vector<ffi::AnyView> views;
    ffi::Shape past_len({past});  // decode_inplace's last input: P, the rows already cached
    if (caps.empty()) {
      views.assign(args.begin(), args.end());
    } else {  // the caches are the capacity buffers, then past_len, then the weights
      std::vector<const ffi::Tensor*> in(n_in);
      for (size_t i = 0; i < n_in; ++i) in[i] = &args[i];
      for (size_t k = 0; k < p.pairs.size(); ++k) in[p.pairs[k].in_index] = &caps[k];
      for (const ffi::Tensor* t : in) views.emplace_back(*t);
      views.emplace_back(past_len);
      for (size_t i = n_in; i < args.size(); ++i) views.emplace_back(args[i]);
    }
    ffi::Any rv;
    const ffi::Function& fn = caps.empty() ? entries.For(args) : entries.inplace_fn;
    ++(&fn == &entries.main_fn ? main_calls : &fn == &entries.step_fn ? step_calls : inplace_calls);
    auto t0 = std::chrono::steady_clock::now();
    try {
      fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &rv);
    } catch (const ffi::Error& e) {
      Fail("main failed (step " + std::to_string(step) + "): " + e.kind() + ": " + LastLine(e.message()));
    }
    auto t1 = std::chrono::steady_clock::now();
    outs.clear();
    auto arr = rv.as<ffi::Array<ffi::Any>>();
    if (!arr || arr->size() != m.outputs.size()) {
      Fail("main did not return the " + std::to_string(m.outputs.size()) + " outputs the manifest lists");
    }
    for (size_t i = 0; i < arr->size(); ++i) {
      auto t = (*arr)[i].as<ffi::Tensor>();
      if (!t || t->GetDLTensorPtr()->device.device_type != kDLCPU || !t->IsContiguous() ||
          std::string(ffi::DLDataTypeToString(t->GetDLTensorPtr()->dtype)) != m.outputs[i].dtype) {
        Fail("output " + m.outputs[i].name + " is not a contiguous CPU tensor of the manifest's dtype");
      }
      outs.push_back(*t);
    }
    // written in place: the same buffers (their shape is the capacity's), one row longer
    // (decode_inplace is main bound at seq 1: compile/decode/inplace.py add_inplace_entry)
    const int64_t grown = caps.empty() ? outs[first.out_index].GetDLTensorPtr()->shape[first.axis] : past + 1;
    if (grown > kMaxSymbolicDim) {
      Refuse("--decode: the cache would grow past " + std::to_string(kMaxSymbolicDim) + " positions");
    }
    std::string tok_text;
    if (p.tokens.on) {
      tokens.push_back(FeedTokens(p.tokens, outs, m, args, cpu));
      tok_text = "  token";
      for (int64_t t : tokens.back()) tok_text += " " + std::to_string(t);
    }
    for (size_t k = 0; k < p.pairs.size(); ++k) {
      const auto& c = p.pairs[k];
      const DLTensor* q = outs[c.out_index].GetDLTensorPtr();
      const DLTensor* was = (caps.empty() ? args[c.in_index] : caps[k]).GetDLTensorPtr();
      bool fits = q->ndim == was->ndim;
      for (int d = 0; fits && d < q->ndim; ++d) fits = d == c.axis || q->shape[d] == was->shape[d];
      if (!caps.empty()) fits = fits && q->data == was->data;  // decode_inplace returns the buffers
      if (!fits) Fail(c.present + " does not have " + c.past + "'s shape (but along axis " + std::to_string(c.axis) + ")");
      if (caps.empty()) args[c.in_index] = outs[c.out_index];  // no copy: the next call reads the module's own tensor
    }
    if (inplace && caps.empty() && step < o.decode - 1) {
      // the prompt's cache into the capacity buffers, once; every later step writes its row
      // there (timed in this step's ms, not its call's)
      for (const auto& c : p.pairs) caps.push_back(CapacityBuffer(outs[c.out_index], c.axis, m.inplace_capacity, cpu));
    }
    filled = grown;
    auto t2 = std::chrono::steady_clock::now();
    step_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
    call_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    std::string what = step ? "step " + std::to_string(step) : "prompt";
    std::printf("%9s: past %5lld + %lld  %8.3f ms (call %.3f ms)%s\n", what.c_str(), static_cast<long long>(past),
                static_cast<long long>(grown - past), step_ms.back(), call_ms.back(), tok_text.c_str());
    std::fflush(stdout);
  }
  if (o.decode > 1) {
    double s = 0, c = 0;
    for (int i = 1; i < o.decode; ++i) s += step_ms[i], c += call_ms[i];
    std::printf("%d steps after the prompt: %.3f ms/token (module call %.3f ms; prompt %.3f ms)\n", o.decode - 1,
                s / (o.decode - 1), c / (o.decode - 1), step_ms[0]);
  }
  if (entries.step_axis >= 0) {
    std::printf("calls: main %d, %s %d", main_calls, m.step_function.c_str(), step_calls);
    if (entries.has_inplace) std::printf(", %s %d", m.inplace_function.c_str(), inplace_calls);
    std::printf("\n");
  }
  if (!tokens.empty()) {
    for (size_t r = 0; r < tokens[0].size(); ++r) {
      std::string row;
      for (const auto& t : tokens) row += (row.empty() ? "" : " ") + std::to_string(t[r]);
      std::printf("tokens[%zu]: %s\n", r, row.c_str());
    }
  }
  if (!o.output.empty()) {
    const DLTensor* dl = outs[0].GetDLTensorPtr();
    std::vector<int64_t> shape(dl->shape, dl->shape + dl->ndim);
    try {
      edge::WriteNpy(o.output, m.outputs[0].dtype, shape, static_cast<const char*>(dl->data) + dl->byte_offset,
                     ffi::GetDataSize(*dl));
    } catch (const std::exception& e) {
      Refuse(e.what());
    }
    std::printf("wrote %s: the last call's %s\n", o.output.c_str(), m.outputs[0].name.c_str());
  }
  return 0;
}

int Run(int argc, char** argv) {
  Options o = ParseArgs(argc, argv);
  const edge::Manifest manifest = ReadManifest(o.artifact);
  const std::string& module = manifest.module;  // one of the hashed files (ParseManifest)
  VerifyFiles(o.artifact, manifest);
  PrivateModule private_module;
  CopyModule(o.artifact, manifest, &private_module);
  const std::string module_path = private_module.path;  // what is checked below and dlopened
  VerifyPackage(o.artifact, manifest);
  const edge::InFile weights = OpenWeights(o.artifact, manifest);
  CheckLoadedRuntime(o.artifact, manifest);
  CheckElf(module_path, module);
  CheckTarget(manifest);
  const std::vector<edge::TensorSig>& in_sigs = manifest.inputs;
  const std::vector<edge::TensorSig>& out_sigs = manifest.outputs;
  edge::Pairing pairing;
  std::set<std::pair<std::string, size_t>> empty_ok;
  if (o.decode) {
    try {
      pairing = edge::InferPairing(manifest);
    } catch (const edge::DecodeError& e) {
      Refuse(o.artifact + ": cannot decode: " + e.what());
    }
    try {
      edge::CheckRecorded(manifest.has_decode ? &manifest.decode : nullptr, pairing);
    } catch (const edge::DecodeError& e) {
      Refuse(o.artifact + ": " + e.what());
    }
    for (const auto& c : pairing.pairs) empty_ok.insert({c.past, static_cast<size_t>(c.axis)});
  } else if (out_sigs.size() != 1) {
    Refuse("the model has " + std::to_string(out_sigs.size()) + " outputs; edge_app writes exactly one");
  }
  std::vector<edge::NpyArray> host_inputs = LoadInputs(o, in_sigs, empty_ok);

  SetThreadsFromCpus();
  const DLDevice cpu{kDLCPU, 0};
  Entries entries;
  std::vector<ffi::Tensor> args;
  try {
    ffi::Module lib = ffi::Module::LoadFromFile(module_path);
    private_module.Remove();  // loaded: nothing of ours stays in $TMPDIR, however the run ends
    ffi::Optional<ffi::Function> load = lib->GetFunction("vm_load_executable", true);
    if (!load) Fail(module + " is not a Relax VM executable (no vm_load_executable)");
    ffi::Module vm = (*load)().cast<ffi::Module>();
    ffi::Optional<ffi::Function> init = vm->GetFunction("vm_initialization", false);
    if (!init) Fail("the VM has no vm_initialization");
    (*init)(static_cast<int>(kDLCPU), 0, kPooledAllocator);
    ffi::Optional<ffi::Function> fn = vm->GetFunction("main", false);
    if (!fn) Fail(module + " has no function 'main'");
    entries.main_fn = *fn;
    if (manifest.has_step) {  // checked by ParseManifest: "decode", a symbolic dim of the inputs
      ffi::Optional<ffi::Function> step = vm->GetFunction(manifest.step_function, false);
      if (!step) {
        Refuse(o.artifact + ": manifest.json's 'step' names function '" + manifest.step_function + "', which " +
               module + " does not have; refusing to run it");
      }
      entries.step_fn = *step;
      if (manifest.has_inplace) {  // checked by ParseManifest: "decode_inplace", with 'step' and 'decode'
        ffi::Optional<ffi::Function> ip = vm->GetFunction(manifest.inplace_function, false);
        if (!ip) {
          Refuse(o.artifact + ": manifest.json's 'inplace' names function '" + manifest.inplace_function +
                 "', which " + module + " does not have; refusing to run it");
        }
        entries.inplace_fn = *ip;
        entries.has_inplace = true;
      }
      for (size_t i = 0; i < in_sigs.size() && entries.step_axis < 0; ++i) {
        for (size_t k = 0; k < in_sigs[i].dims.size(); ++k) {
          if (in_sigs[i].fixed[k] == edge::TensorSig::kSymbol && in_sigs[i].dims[k] == manifest.step_dim) {
            entries.step_input = i;
            entries.step_axis = static_cast<int>(k);
            break;
          }
        }
      }
    }
    for (size_t i = 0; i < in_sigs.size(); ++i) {
      const edge::NpyArray& a = host_inputs[i];
      ffi::Tensor t = ffi::Tensor::FromNDAlloc(AlignedCPUAlloc(), ffi::Shape(a.shape),
                                               ffi::StringToDLDataType(in_sigs[i].dtype), cpu);
      if (ffi::GetDataSize(*t.GetDLTensorPtr()) != a.data.size()) Fail("input size mismatch for " + a.dtype);
      if (!a.data.empty()) std::memcpy(t.data_ptr(), a.data.data(), a.data.size());
      args.push_back(std::move(t));
    }
    for (ffi::Tensor& w : ReadWeights(o.artifact, weights, manifest, cpu)) args.push_back(std::move(w));
  } catch (const ffi::Error& e) {
    Fail("cannot load " + module + ": " + e.kind() + ": " + LastLine(e.message()));
  }

  if (o.decode) return DecodeLoop(o, manifest, pairing, entries, std::move(args), cpu);
  const ffi::Function& main_fn = entries.For(args);
  std::vector<ffi::AnyView> views(args.begin(), args.end());
  ffi::Any rv;
  std::vector<double> ms;
  try {
    main_fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &rv);  // warm-up
    for (int r = 0; r < o.repeat; ++r) {
      rv = ffi::Any();
      auto t0 = std::chrono::steady_clock::now();
      main_fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &rv);
      auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  } catch (const ffi::Error& e) {
    Fail("main failed: " + e.kind() + ": " + LastLine(e.message()));
  }

  size_t count = 0;
  ffi::Tensor out = FirstTensor(rv, &count);
  if (count != 1) Fail("main returned " + std::to_string(count) + " outputs, the manifest lists 1");
  const DLTensor* dl = out.GetDLTensorPtr();
  std::string dtype = std::string(ffi::DLDataTypeToString(dl->dtype));
  std::vector<int64_t> shape(dl->shape, dl->shape + dl->ndim);
  if (dl->device.device_type != kDLCPU || !out.IsContiguous()) {
    Fail("output is not a contiguous CPU tensor");
  }
  if (dtype != out_sigs[0].dtype) {
    Fail("output has dtype " + dtype + ", the manifest says " + out_sigs[0].dtype);
  }
  try {
    edge::WriteNpy(o.output, dtype, shape,
                   static_cast<const char*>(dl->data) + dl->byte_offset, ffi::GetDataSize(*dl));
  } catch (const std::exception& e) {
    Refuse(e.what());
  }
  std::sort(ms.begin(), ms.end());
  size_t n = ms.size();
  double median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  std::printf("ran main in %.3f ms (median of %zu)\n", median, n);
  std::printf("wrote %s: %s %s %s\n", o.output.c_str(), out_sigs[0].name.c_str(), dtype.c_str(),
              ShapeStr(shape).c_str());
  return 0;
}

// Ctrl-C (and SIGTERM, SIGHUP): the private module copy and a half-written output's
// temporary removed, one line, exit 128 + the signal, as a shell reports it. Only
// async-signal-safe calls here; it may run on any thread (TVM's pool included).
extern "C" void OnInterrupt(int sig) {
  edge::RemoveDoomed();
  static const char kInt[] = "edge_app: interrupted\n", kTerm[] = "edge_app: terminated\n";
  const char* msg = sig == SIGINT ? kInt : kTerm;
  ssize_t put = ::write(STDERR_FILENO, msg, std::strlen(msg));
  (void)put;
  ::_exit(128 + sig);
}

void HandleInterrupts() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&sa.sa_mask, sig);  // one handler at a time
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old;
    // An ignored signal stays ignored (nohup, a background job of a non-interactive shell).
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    ::sigaction(sig, &sa, nullptr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  HandleInterrupts();
  try {
    return Run(argc, argv);
  } catch (const Failure& f) {
    std::fprintf(stderr, "edge_app: error: %s\n", OneLine(f.message).c_str());
    if (f.usage) std::fprintf(stderr, "%s\n", kUsage);
    return f.code;
  } catch (const ffi::Error& e) {
    std::fprintf(stderr, "edge_app: error: %s: %s\n", OneLine(e.kind()).c_str(),
                 OneLine(LastLine(e.message())).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "edge_app: error: %s\n", OneLine(e.what()).c_str());
    return 1;
  }
}

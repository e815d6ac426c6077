// edge_app: run a blockforge artifact (module.so + manifest.json) with the TVM
// runtime, without Python.
//
//   edge_app ARTIFACT_DIR --input NAME=FILE.npy [--input ...] --output OUT.npy [--repeat N]
//
// Before module.so is loaded (loading runs its native code) the app checks that it
// matches its sha256 in manifest.json and that it is an ELF for this CPU; inputs are
// checked against the manifest's signature. Exit codes: 0 ok, 2 refused (usage, bad
// artifact or inputs), 1 the runtime failed.
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "json.h"
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

const char* kUsage =
    "usage: edge_app ARTIFACT_DIR --input NAME=FILE.npy [--input ...] --output OUT.npy "
    "[--repeat N]";

// An error with the exit code it ends the program with.
struct Failure {
  int code;
  std::string message;
};

[[noreturn]] void Refuse(const std::string& msg) { throw Failure{2, msg}; }
[[noreturn]] void Fail(const std::string& msg) { throw Failure{1, msg}; }

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
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  auto value = [&](int& i, const std::string& flag) -> std::string {
    std::string a = argv[i];
    if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) {
      return a.substr(flag.size() + 1);
    }
    if (i + 1 >= argc) Refuse(flag + " needs a value\n" + kUsage);
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
    } else if (!a.empty() && a[0] == '-') {
      Refuse("unknown option " + a + "\n" + kUsage);
    } else if (o.artifact.empty()) {
      o.artifact = a;
    } else {
      Refuse("unexpected argument '" + a + "'\n" + kUsage);
    }
  }
  if (o.artifact.empty()) Refuse(std::string("no artifact directory given\n") + kUsage);
  if (o.output.empty()) Refuse(std::string("--output OUT.npy is required\n") + kUsage);
  return o;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return static_cast<bool>(f) || f.eof();
}

bool IsPlainName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

// One manifest tensor signature entry; shape dims are ints or symbolic names.
struct TensorSig {
  std::string name;
  std::string dtype;
  std::vector<std::string> dims;    // as text, for messages
  std::vector<int64_t> fixed;       // -1 where symbolic
};

std::vector<TensorSig> ReadSigs(const edge::json::Value& m, const char* key) {
  const edge::json::Value* list = m.get(key);
  if (!list || !list->is_array()) Refuse(std::string("manifest.json: '") + key + "' is not a list");
  std::vector<TensorSig> sigs;
  for (const auto& item : list->array) {
    const auto* name = item.get("name");
    const auto* dtype = item.get("dtype");
    const auto* shape = item.get("shape");
    if (!name || !name->is_string() || !dtype || !dtype->is_string() || !shape || !shape->is_array()) {
      Refuse(std::string("manifest.json: malformed entry in '") + key + "'");
    }
    TensorSig s{name->str, dtype->str, {}, {}};
    for (const auto& d : shape->array) {
      if (d.is_int() && d.number >= 0) {
        s.dims.push_back(std::to_string(static_cast<int64_t>(d.number)));
        s.fixed.push_back(static_cast<int64_t>(d.number));
      } else if (d.is_string()) {
        s.dims.push_back(d.str);
        s.fixed.push_back(-1);
      } else {
        Refuse(std::string("manifest.json: bad shape entry for ") + key + " '" + s.name + "'");
      }
    }
    sigs.push_back(std::move(s));
  }
  return sigs;
}

edge::json::Value ReadManifest(const std::string& dir) {
  std::string text;
  std::string path = dir + "/manifest.json";
  if (!ReadFile(path, &text)) {
    struct stat st;
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) Refuse(dir + ": not an artifact directory");
    Refuse(dir + ": no manifest.json (not a blockforge artifact)");
  }
  edge::json::Value m;
  try {
    m = edge::json::Parse(text);
  } catch (const std::exception& e) {
    Refuse(path + ": corrupt manifest (" + e.what() + ")");
  }
  const auto* fmt = m.get("format");
  if (!m.is_object() || !fmt || !fmt->is_string() || fmt->str != "blockforge.artifact/1") {
    Refuse(path + ": unknown manifest format (expected blockforge.artifact/1)");
  }
  for (const char* key : {"files", "target", "inputs", "outputs", "module"}) {
    if (!m.get(key)) Refuse(path + ": manifest lacks '" + key + "'");
  }
  return m;
}

// Every file the manifest lists must match its sha256 (module.so above all: it is
// about to be loaded, which runs its code).
void VerifyFiles(const std::string& dir, const edge::json::Value& m, const std::string& module) {
  const auto* files = m.get("files");
  if (!files->is_object() || !files->get(module)) {
    Refuse("manifest.json lists no sha256 for " + module + "; refusing to load it");
  }
  for (const auto& kv : files->object) {
    if (!IsPlainName(kv.first) || !kv.second.is_string()) {
      Refuse("manifest.json: bad entry in 'files': '" + kv.first + "'");
    }
    std::string got;
    if (!edge::Sha256File(dir + "/" + kv.first, &got)) Refuse(dir + ": " + kv.first + " is missing");
    if (got != kv.second.str) {
      Refuse(kv.first + " does not match its sha256 in manifest.json (tampered or corrupted); "
             "refusing to load it");
    }
  }
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
  struct stat st;
  FILE* f = std::fopen(path.c_str(), "rb");
  bool read = f && fstat(fileno(f), &st) == 0 && std::fread(&b[0], 1, 64, f) == 64;
  if (!read || b.compare(0, 4, "\x7f" "ELF") != 0) {
    if (f) std::fclose(f);
    Refuse(module + " is not an ELF shared library");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size), phoff = LoadLE(b, 32, 8),
                 phentsize = LoadLE(b, 54, 2), phnum = LoadLE(b, 56, 2);
  std::string ph;
  bool ok = b[4] == 2 && phentsize >= 56 && phoff <= size && phnum * phentsize <= size - phoff;
  if (ok) {
    ph.resize(static_cast<size_t>(phnum * phentsize));
    ok = fseeko(f, static_cast<off_t>(phoff), SEEK_SET) == 0 &&
         std::fread(&ph[0], 1, ph.size(), f) == ph.size();
  }
  std::fclose(f);
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

void CheckTarget(const edge::json::Value& m) {
  const auto* target = m.get("target");
  if (!target || !target->is_object()) return;
  const auto* arch = target->get("arch");
  if (arch && arch->is_string() && arch->str != kArch) {
    Refuse("artifact is built for " + arch->str + " (manifest target.arch), this is " + kArch);
  }
  const auto* device = target->get("device");
  if (device && device->is_string() && device->str != "cpu") {
    Refuse("artifact targets device '" + device->str + "'; edge_app runs CPU artifacts only");
  }
  if (device && device->kind == edge::json::Value::kNull) {
    Refuse("artifact is build-only (no device to run on)");
  }
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

// Loads and checks the inputs against the signature, in manifest order.
std::vector<edge::NpyArray> LoadInputs(const Options& o, const std::vector<TensorSig>& sigs) {
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
    edge::NpyArray a;
    try {
      a = edge::ReadNpy(it->second);
    } catch (const std::exception& e) {
      Refuse("input '" + s.name + "': " + e.what());
    }
    if (a.dtype != s.dtype) {
      Refuse("input '" + s.name + "': " + it->second + " has dtype " + a.dtype + ", the model takes " +
             s.dtype);
    }
    bool ok = a.shape.size() == s.fixed.size();
    for (size_t i = 0; ok && i < s.fixed.size(); ++i) {
      if (s.fixed[i] >= 0) {
        ok = a.shape[i] == s.fixed[i];
      } else {
        auto b = bound.find(s.dims[i]);
        if (b == bound.end()) {
          bound[s.dims[i]] = {a.shape[i], s.name};
        } else if (b->second.first != a.shape[i]) {
          Refuse("input '" + s.name + "': dim '" + s.dims[i] + "' is " + std::to_string(a.shape[i]) +
                 " here but " + std::to_string(b->second.first) + " in '" + b->second.second + "'");
        }
      }
    }
    if (!ok) {
      Refuse("input '" + s.name + "': shape " + ShapeStr(a.shape) + " does not match the model's " +
             ShapeStr(s.dims));
    }
    arrays.push_back(std::move(a));
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

int Run(int argc, char** argv) {
  Options o = ParseArgs(argc, argv);
  edge::json::Value manifest = ReadManifest(o.artifact);
  const auto* mod_entry = manifest.get("module");
  if (!mod_entry->is_string() || !IsPlainName(mod_entry->str)) {
    Refuse("manifest.json: 'module' must name a file in the artifact");
  }
  const std::string module = mod_entry->str;
  const std::string module_path = o.artifact + "/" + module;
  VerifyFiles(o.artifact, manifest, module);
  CheckElf(module_path, module);
  CheckTarget(manifest);
  std::vector<TensorSig> in_sigs = ReadSigs(manifest, "inputs");
  std::vector<TensorSig> out_sigs = ReadSigs(manifest, "outputs");
  if (out_sigs.size() != 1) {
    Refuse("the model has " + std::to_string(out_sigs.size()) + " outputs; edge_app writes exactly one");
  }
  std::vector<edge::NpyArray> host_inputs = LoadInputs(o, in_sigs);

  SetThreadsFromCpus();
  const DLDevice cpu{kDLCPU, 0};
  ffi::Function main_fn;
  std::vector<ffi::Tensor> args;
  try {
    ffi::Module lib = ffi::Module::LoadFromFile(module_path);
    ffi::Optional<ffi::Function> load = lib->GetFunction("vm_load_executable", true);
    if (!load) Fail(module + " is not a Relax VM executable (no vm_load_executable)");
    ffi::Module vm = (*load)().cast<ffi::Module>();
    ffi::Optional<ffi::Function> init = vm->GetFunction("vm_initialization", false);
    if (!init) Fail("the VM has no vm_initialization");
    (*init)(static_cast<int>(kDLCPU), 0, kPooledAllocator);
    ffi::Optional<ffi::Function> fn = vm->GetFunction("main", false);
    if (!fn) Fail(module + " has no function 'main'");
    main_fn = *fn;
    for (size_t i = 0; i < in_sigs.size(); ++i) {
      const edge::NpyArray& a = host_inputs[i];
      ffi::Tensor t = ffi::Tensor::FromNDAlloc(AlignedCPUAlloc(), ffi::Shape(a.shape),
                                               ffi::StringToDLDataType(in_sigs[i].dtype), cpu);
      if (ffi::GetDataSize(*t.GetDLTensorPtr()) != a.data.size()) Fail("input size mismatch for " + a.dtype);
      if (!a.data.empty()) std::memcpy(t.data_ptr(), a.data.data(), a.data.size());
      args.push_back(std::move(t));
    }
  } catch (const ffi::Error& e) {
    Fail("cannot load " + module + ": " + e.kind() + ": " + LastLine(e.message()));
  }

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

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const Failure& f) {
    std::fprintf(stderr, "edge_app: error: %s\n", f.message.c_str());
    return f.code;
  } catch (const ffi::Error& e) {
    std::fprintf(stderr, "edge_app: error: %s: %s\n", e.kind().c_str(), LastLine(e.message()).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "edge_app: error: %s\n", e.what());
    return 1;
  }
}

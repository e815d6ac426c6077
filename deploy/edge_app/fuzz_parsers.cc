// fuzz_parsers: an AFL-style mutation fuzzer for edge_app's .npy and manifest readers,
// built with g++ (libFuzzer needs clang): ASan + UBSan catch memory errors and undefined
// behaviour, -fsanitize-coverage=trace-pc on the parsers gives edge coverage, and an
// input that reaches new edges joins the corpus. Deterministic for a given seed and
// iteration count (a --seconds bound makes the count depend on the machine's speed).
//
//   fuzz_parsers [--seconds S] [--iterations N] [--seed N] [--crash-dir DIR]
//                [--emit DIR --emit-count N] [SEED_FILE ...]
//   fuzz_parsers --verdict FILE ...
//
// SEED_FILEs ending in .npy seed the .npy reader, others the manifest reader; built-in
// seeds are always added. A bug (a sanitizer report, an exception other than the
// parser's own, an accepted input that breaks the parser's promises) writes the input to
// DIR/crash-<kind>-<hash> and exits 1. The last stdout line is a JSON summary.
// --emit writes N fresh manifest mutants and verdicts.txt ("FILE accepted" or
// "FILE refused MESSAGE" per line) for a differential test against the Python reader.
#include <sanitizer/common_interface_defs.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_parsers.h"

namespace {

using edge_fuzz::Kind;
using edge_fuzz::Verdict;

// ------------------------------------------------------------------ coverage
constexpr size_t kMapSize = 1 << 16;
uint8_t g_hits[kMapSize];
uint8_t g_seen[kMapSize];  // per edge: the hit-count buckets seen so far (AFL's)
uintptr_t g_prev = 0;
bool g_coverage_on = false;

uint8_t Bucket(uint8_t n) {
  if (n == 0) return 0;
  if (n <= 3) return static_cast<uint8_t>(1u << (n - 1));
  if (n <= 7) return 8;
  if (n <= 15) return 16;
  if (n <= 31) return 32;
  if (n <= 127) return 64;
  return 128;
}

// Whether the last run reached an edge, or an edge's hit-count bucket, not seen before.
bool NewCoverage() {
  bool fresh = false;
  for (size_t i = 0; i < kMapSize; ++i) {
    if (!g_hits[i]) continue;
    uint8_t b = Bucket(g_hits[i]);
    if ((g_seen[i] & b) == 0) {
      g_seen[i] |= b;
      fresh = true;
    }
  }
  return fresh;
}

size_t EdgesSeen() {
  size_t n = 0;
  for (uint8_t v : g_seen) n += v != 0;
  return n;
}

// ------------------------------------------------------------------ crash capture
const std::string* g_current = nullptr;
Kind g_current_kind = Kind::kNpy;
std::string g_crash_dir = ".";

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string SaveCrash() {
  if (!g_current) return "";
  char name[64];
  std::snprintf(name, sizeof(name), "/crash-%s-%016llx", g_current_kind == Kind::kNpy ? "npy" : "manifest",
                static_cast<unsigned long long>(Fnv1a(*g_current)));
  std::string path = g_crash_dir + name;
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(g_current->data(), 1, g_current->size(), f);
    std::fclose(f);
  }
  return path;
}

// Called by ASan/UBSan before they end the process.
void OnSanitizerDeath() {
  std::string path = SaveCrash();
  std::fprintf(stderr, "fuzz_parsers: sanitizer report above; input saved to %s\n", path.c_str());
}

// ------------------------------------------------------------------ seeds
std::string NpyBytes(const std::string& descr, const std::string& shape, size_t nbytes, int version = 1) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  size_t pre = version == 1 ? 10 : 12;
  dict.append((64 - (pre + dict.size() + 1) % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out = std::string("\x93NUMPY", 6) + static_cast<char>(version) + '\0';
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>((dict.size() >> 8) & 0xff));
  if (version != 1) out += std::string(2, '\0');
  out += dict;
  std::string data(nbytes, '\0');
  for (size_t i = 0; i < nbytes; ++i) data[i] = static_cast<char>(i * 7);
  return out + data;
}

const char* kManifestSeed = R"({
  "dims": {"batch": 1, "seq": 16},
  "files": {"module.so": "de95b925d06d7069a4f5b587d098d2979c2260e21d249b7ac8dd6520f164d530",
            "kernels.c": "0000000000000000000000000000000000000000000000000000000000000000",
            "weights.bin": "1111111111111111111111111111111111111111111111111111111111111111"},
  "format": "blockforge.artifact/1",
  "inputs": [{"dtype": "float32", "name": "query", "shape": ["batch", "seq", 64]},
             {"dtype": "bool", "name": "key_padding_mask", "shape": ["batch", null]}],
  "module": "module.so",
  "outputs": [{"dtype": "float32", "name": "output", "shape": ["batch", "seq", 64]}],
  "params_embedded": true,
  "phases": ["import", "legalize", "prepack"],
  "target": {"arch": "x86_64", "device": "cpu", "json": {"kind": "llvm", "mcpu": "znver4", "num-cores": 2},
             "key": "llvm-znver4-2c", "name": "host"},
  "tuning": null,
  "weights": {"bytes": 4160, "file": "weights.bin", "tensors": [
    {"dtype": "float32", "name": "w0", "nbytes": 4096, "offset": 0, "shape": [16, 64]},
    {"dtype": "bool", "name": "w1", "nbytes": 3, "offset": 4096, "shape": [3]}]},
  "versions": {"tvm": "0.27.0", "x": [1.5, -2e-3, "\u00e9\ud83d\ude00"]}
})";

// ------------------------------------------------------------------ mutation
struct Entry {
  Kind kind;
  std::string data;
  bool accepted = false;
};

const std::vector<std::string>& Tokens() {
  static const std::vector<std::string> t = {
      "{", "}", "[", "]", "(", ")", ",", ":", "\"", "'", "\\", "\\u", "\\ud800", "\\udc00", "null", "true",
      "false", "True", "False", "-", "e", ".", " ", "\n", "\xc3\xa9", "\xed\xa0\x80", "\xf4\x90\x80\x80",
      "\"module\": ", "\"files\": {}", "\"shape\": ", "'shape': ", "'descr': ", "'fortran_order': ",
      "\"format\": \"blockforge.artifact/1\"", "[[[[[[[[[[[[[[[[", "{\"a\":{\"a\":{\"a\":{\"a\":"};
  return t;
}

const std::vector<std::string>& Numbers() {
  static const std::vector<std::string> n = {
      "0", "1", "-1", "-0", "2", "7", "64", "65535", "65536", "65537", "2147483647", "2147483648",
      "4294967296", "9007199254740993", "72057594037927937", "4611686018427387904", "9223372036854775807",
      "9223372036854775808", "18446744073709551615", "18446744073709551616", "1e23", "1E400", "1.5", "-1e-9",
      "00", "01", "1.", ".5", "+1", std::string(120, '9')};
  return n;
}

const std::vector<std::string>& Strings() {
  static const std::vector<std::string> s = {
      "", ".", "..", "../module.so", "/etc/passwd", "/tmp/x.so", "a/b", "a\\\\b", ".hidden", "module.so",
      "kernels.c", "x.so", "\\ud800", "\\udc00x", "\\u0000", "\\u001f", "\\n", std::string(64, 'a'),
      std::string(63, '0'), std::string(64, 'F'), "float32", "float16", "bool", "bfloat16", "Float32", "<f4",
      ">f4", "=f4", "|b1", "|O", "<U8", "cpu", "cuda", "x86_64", "aarch64", "seq", "batch", "blockforge.artifact/2",
      std::string(300, 'n')};
  return s;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t Below(size_t n) { return n ? static_cast<size_t>(rng_() % n) : 0; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Below(v.size())];
  }

  // One structure-aware change (a number, a string, a value of another type): close
  // to valid, so many children are still accepted.
  std::string Tweak(const Entry& e) {
    std::string d = e.data;
    switch (Below(3)) {
      case 0: ReplaceNumber(&d); break;
      case 1: ReplaceString(&d); break;
      default: ReplaceValue(&d); break;
    }
    return d;
  }

  std::string Mutate(const Entry& e, const std::vector<Entry>& corpus) {
    std::string d = e.data;
    const int rounds = 1 + static_cast<int>(Below(4));
    for (int r = 0; r < rounds; ++r) Once(&d, e.kind, corpus);
    if (d.size() > kMaxInput) d.resize(kMaxInput);
    return d;
  }

 private:
  static constexpr size_t kMaxInput = 1 << 16;

  void Once(std::string* d, Kind kind, const std::vector<Entry>& corpus) {
    const size_t n = d->size();
    switch (Below(13)) {
      case 0:  // bit flip
        if (n) (*d)[Below(n)] ^= static_cast<char>(1u << Below(8));
        break;
      case 1: {  // interesting byte
        static const char kBytes[] = {0, 1, 0x7f, '\x80', '\xff', '"', '\\', '{', '}', '(', ')', ',', ':', '\n', ' '};
        if (n) (*d)[Below(n)] = kBytes[Below(sizeof(kBytes))];
        break;
      }
      case 2:  // delete a range
        if (n) {
          size_t at = Below(n);
          d->erase(at, 1 + Below(std::min<size_t>(16, n - at)));
        }
        break;
      case 3: {  // random bytes
        std::string junk(1 + Below(8), '\0');
        for (char& c : junk) c = static_cast<char>(Below(256));
        d->insert(Below(n + 1), junk);
        break;
      }
      case 4:  // duplicate a chunk
        if (n) {
          size_t at = Below(n), len = 1 + Below(std::min<size_t>(64, n - at));
          d->insert(Below(n + 1), d->substr(at, len));
        }
        break;
      case 5:
        d->insert(Below(n + 1), Pick(Tokens()));
        break;
      case 6:
        ReplaceNumber(d);
        break;
      case 7:
        ReplaceString(d);
        break;
      case 8:
        ReplaceValue(d);
        break;
      case 9: {  // splice with another entry of the same kind
        const Entry& other = corpus[Below(corpus.size())];
        if (other.kind == kind && !other.data.empty()) {
          *d = d->substr(0, Below(n + 1)) + other.data.substr(Below(other.data.size()));
        }
        break;
      }
      case 10:  // truncate
        d->resize(Below(n + 1));
        break;
      case 11:  // .npy: header length field and version
        if (kind == Kind::kNpy && n >= 12) {
          static const uint32_t kLens[] = {0, 1, 0x7fff, 0xffff, 0x10000, 0xffffffffu, 118, 70};
          uint32_t v = kLens[Below(sizeof(kLens) / sizeof(kLens[0]))];
          size_t at = 8 + Below(2) * 2;
          (*d)[at] = static_cast<char>(v & 0xff);
          (*d)[at + 1] = static_cast<char>((v >> 8) & 0xff);
          if (Below(4) == 0) (*d)[6] = static_cast<char>(Below(5));
        } else {
          ReplaceNumber(d);
        }
        break;
      default:  // a number, again: dims and sizes are where the bugs were
        ReplaceNumber(d);
        break;
    }
  }

  // A run of digits (with sign, point, exponent) replaced by an interesting number.
  void ReplaceNumber(std::string* d) {
    if (d->empty()) return;
    size_t at = d->find_first_of("0123456789", Below(d->size()));
    if (at == std::string::npos) at = d->find_first_of("0123456789");
    if (at == std::string::npos) return;
    size_t end = at;
    while (end < d->size() && std::strchr("0123456789.eE+-", (*d)[end]) && (*d)[end] != '\0') ++end;
    d->replace(at, end - at, Pick(Numbers()));
  }

  // The contents of a quoted string replaced by an interesting string.
  void ReplaceString(std::string* d) {
    if (d->empty()) return;
    size_t open = d->find_first_of("\"'", Below(d->size()));
    if (open == std::string::npos) open = d->find_first_of("\"'");
    if (open == std::string::npos) return;
    size_t close = d->find((*d)[open], open + 1);
    if (close == std::string::npos) return;
    d->replace(open + 1, close - open - 1, Pick(Strings()));
  }

  // The value after a ':' (up to the next ',' '}' or ']' at its level) replaced by
  // another type of value.
  void ReplaceValue(std::string* d) {
    static const std::vector<std::string> kValues = {
        "[]", "{}", "null", "true", "\"x\"", "1", "-1", "1.5", "[1, 2]", "{\"a\": 1}", "[\"batch\", \"batch\"]",
        "[null]", "\"module.so\"", "[{\"name\": \"x\", \"shape\": [], \"dtype\": \"float32\"}]",
        "{\"module.so\": \"" + std::string(64, 'a') + "\"}", "(1,)", "()", "(1, 2, 3)"};
    if (d->empty()) return;
    size_t colon = d->find(':', Below(d->size()));
    if (colon == std::string::npos) colon = d->find(':');
    if (colon == std::string::npos) return;
    size_t i = colon + 1;
    int depth = 0;
    bool in_str = false;
    for (; i < d->size(); ++i) {
      char c = (*d)[i];
      if (in_str) {
        if (c == '\\') ++i;
        else if (c == '"') in_str = false;
        continue;
      }
      if (c == '"') in_str = true;
      else if (c == '{' || c == '[' || c == '(') ++depth;
      else if ((c == '}' || c == ']' || c == ')') && depth-- == 0) break;
      else if (c == ',' && depth == 0) break;
    }
    d->replace(colon + 1, i - colon - 1, " " + Pick(kValues));
  }

  std::mt19937_64 rng_;
};

// ------------------------------------------------------------------ driver
Verdict Run(Kind kind, const std::string& data, std::string* msg) {
  g_current = &data;
  g_current_kind = kind;
  std::memset(g_hits, 0, sizeof(g_hits));
  g_prev = 0;
  Verdict v = edge_fuzz::RunTarget(kind, data, msg);
  g_current = nullptr;
  return v;
}

[[noreturn]] void ReportBug(Kind kind, const std::string& data, const std::string& msg) {
  g_current = &data;
  g_current_kind = kind;
  std::string path = SaveCrash();
  std::fprintf(stderr, "fuzz_parsers: bug in the %s reader: %s; input saved to %s\n",
               kind == Kind::kNpy ? "npy" : "manifest", msg.c_str(), path.c_str());
  std::exit(1);
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool ReadWhole(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

std::string OneLine(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out.push_back(c < 0x20 || c == 0x7f ? '?' : static_cast<char>(c));
  return out;
}

int Verdicts(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string data, msg;
    if (!ReadWhole(argv[i], &data)) {
      std::fprintf(stderr, "fuzz_parsers: cannot read %s\n", argv[i]);
      return 2;
    }
    Kind kind = EndsWith(argv[i], ".npy") ? Kind::kNpy : Kind::kManifest;
    Verdict v = Run(kind, data, &msg);
    if (v == Verdict::kBug) ReportBug(kind, data, msg);
    std::printf("%s %s%s%s\n", argv[i], v == Verdict::kAccepted ? "accepted" : "refused",
                msg.empty() ? "" : " ", OneLine(msg).c_str());
  }
  return 0;
}

}  // namespace

// Edge coverage: g++ calls this at every basic block of the instrumented parsers.
extern "C" void __sanitizer_cov_trace_pc() {
  const uintptr_t pc = reinterpret_cast<uintptr_t>(__builtin_return_address(0));
  const uintptr_t cur = (pc * 0x9E3779B97F4A7C15ull) >> 48;  // 16 bits
  ++g_hits[(cur ^ g_prev) & (kMapSize - 1)];
  g_prev = cur >> 1;
  g_coverage_on = true;
}

int main(int argc, char** argv) {
  double seconds = 10;
  uint64_t iterations = UINT64_MAX, seed = 1;
  std::string emit_dir;
  size_t emit_count = 0;
  std::vector<std::string> seed_files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fuzz_parsers: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--verdict") return Verdicts(argc, argv, i + 1);
    if (a == "--seconds") seconds = std::atof(next().c_str());
    else if (a == "--iterations") iterations = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--seed") seed = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--crash-dir") g_crash_dir = next();
    else if (a == "--emit") emit_dir = next();
    else if (a == "--emit-count") emit_count = std::strtoull(next().c_str(), nullptr, 10);
    else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "fuzz_parsers: unknown option %s\n", a.c_str());
      return 2;
    } else {
      seed_files.push_back(a);
    }
  }
  __sanitizer_set_death_callback(OnSanitizerDeath);

  std::vector<Entry> corpus = {
      {Kind::kNpy, NpyBytes("<f4", "(1, 4, 8)", 128)},
      {Kind::kNpy, NpyBytes("|b1", "(2, 3)", 6)},
      {Kind::kNpy, NpyBytes("<f2", "(5,)", 10, 2)},
      {Kind::kNpy, NpyBytes("<i8", "()", 8, 3)},
      {Kind::kManifest, kManifestSeed},
  };
  for (const std::string& path : seed_files) {
    Entry e{EndsWith(path, ".npy") ? Kind::kNpy : Kind::kManifest, ""};
    if (!ReadWhole(path, &e.data)) {
      std::fprintf(stderr, "fuzz_parsers: cannot read seed %s\n", path.c_str());
      return 2;
    }
    corpus.push_back(std::move(e));
  }
  const size_t n_seeds = corpus.size();
  uint64_t accepted[2] = {0, 0}, refused[2] = {0, 0};
  std::string msg;
  for (Entry& e : corpus) {  // the seeds: run once, their coverage is the baseline
    Verdict v = Run(e.kind, e.data, &msg);
    if (v == Verdict::kBug) ReportBug(e.kind, e.data, msg);
    e.accepted = v == Verdict::kAccepted;
    NewCoverage();
  }

  Mutator mut(seed);
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&]() { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  uint64_t it = 0;
  for (; it < iterations; ++it) {
    if ((it & 255) == 0 && elapsed() >= seconds) break;
    const Entry& parent = corpus[mut.Below(corpus.size())];
    Entry child{parent.kind, mut.Mutate(parent, corpus)};
    Verdict v = Run(child.kind, child.data, &msg);
    if (v == Verdict::kBug) ReportBug(child.kind, child.data, msg);
    (v == Verdict::kAccepted ? accepted : refused)[child.kind == Kind::kNpy ? 0 : 1]++;
    child.accepted = v == Verdict::kAccepted;
    if (NewCoverage() && corpus.size() < 8192) corpus.push_back(std::move(child));
  }
  const double secs = elapsed();

  if (!emit_dir.empty()) {
    std::ofstream verdicts(emit_dir + "/verdicts.txt");
    std::vector<const Entry*> manifests, valid;
    for (const Entry& e : corpus) {
      if (e.kind == Kind::kManifest) manifests.push_back(&e);
      if (e.kind == Kind::kManifest && e.accepted) valid.push_back(&e);
    }
    for (size_t k = 0; k < emit_count; ++k) {
      // A third corpus entries as they are (each reached new code), a third one-change
      // tweaks of accepted manifests (the type checks' borderline), a third havoc mutants.
      std::string data;
      if (k % 3 == 0) {
        data = manifests[mut.Below(manifests.size())]->data;
      } else if (k % 3 == 1 && !valid.empty()) {
        data = mut.Tweak(*valid[mut.Below(valid.size())]);
      } else {
        data = mut.Mutate(*manifests[mut.Below(manifests.size())], corpus);
      }
      Verdict v = Run(Kind::kManifest, data, &msg);
      if (v == Verdict::kBug) ReportBug(Kind::kManifest, data, msg);
      char name[32];
      std::snprintf(name, sizeof(name), "m%05zu.json", k);
      std::ofstream(emit_dir + "/" + name, std::ios::binary) << data;
      verdicts << name << (v == Verdict::kAccepted ? " accepted" : " refused ") << OneLine(msg) << "\n";
    }
  }

  size_t corpus_kind[2] = {0, 0};
  for (const Entry& e : corpus) corpus_kind[e.kind == Kind::kNpy ? 0 : 1]++;
  std::printf(
      "{\"seconds\": %.1f, \"iterations\": %llu, \"execs_per_second\": %.0f, \"seed\": %llu, "
      "\"coverage\": %s, \"edges\": %zu, \"seeds\": %zu, \"corpus\": {\"npy\": %zu, \"manifest\": %zu}, "
      "\"accepted\": {\"npy\": %llu, \"manifest\": %llu}, \"refused\": {\"npy\": %llu, \"manifest\": %llu}, "
      "\"bugs\": 0}\n",
      secs, static_cast<unsigned long long>(it), secs > 0 ? it / secs : 0.0, static_cast<unsigned long long>(seed),
      g_coverage_on ? "true" : "false", EdgesSeen(), n_seeds, corpus_kind[0], corpus_kind[1],
      static_cast<unsigned long long>(accepted[0]), static_cast<unsigned long long>(accepted[1]),
      static_cast<unsigned long long>(refused[0]), static_cast<unsigned long long>(refused[1]));
  return 0;
}

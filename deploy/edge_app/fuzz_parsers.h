// The fuzz targets (fuzz_targets.cc, built with edge coverage) as the driver
// (fuzz_parsers.cc) sees them.
#ifndef EDGE_APP_FUZZ_PARSERS_H_
#define EDGE_APP_FUZZ_PARSERS_H_

#include <string>

namespace edge_fuzz {

enum class Kind { kNpy, kManifest };
enum class Verdict { kAccepted, kRefused, kBug };

// Runs one parser on `data` in-process. kAccepted: parsed, and the result keeps the
// parser's promises (sizes agree, names plain, dims in range); kRefused: the parser's
// own error (message set); kBug: anything else (another exception type, a broken
// promise; message says which). Memory errors and undefined behaviour are the
// sanitizers' to report.
Verdict RunTarget(Kind kind, const std::string& data, std::string* message);

}  // namespace edge_fuzz

#endif  // EDGE_APP_FUZZ_PARSERS_H_

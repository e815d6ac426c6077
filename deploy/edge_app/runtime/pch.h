// The headers most units of the cross-built runtime include, precompiled once (Makefile:
// A64_PCH) and forced into each unit.
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

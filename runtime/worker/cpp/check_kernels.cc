// A standalone check of the C++ kernels, for CPUs the engine is not run on here: it calls each
// kernel through its XLA FFI entry point (the very symbols XLA calls: JaxservePagedDecode,
// JaxserveInt8Matmul, ...) on the cases of a file, and compares every result with the case's
// reference values, in a process of its own, without XLA. tests/test_cpp_kernels.py writes the cases
// (inputs from the test's random draws, references from its plain numpy products) and runs this
// program built with a cross compiler under qemu-user:
//
//   aarch64-linux-gnu-g++ -O3 -march=armv8-a -ffast-math -fopenmp-simd -std=c++17 \
//       -I$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       runtime/worker/cpp/{check_kernels,paged_decode,matmul,block_matmul,tile_matmul}.cc \
//       -o /tmp/check_kernels -lpthread
//   qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/check_kernels cases.bin
//
// It prints one line per case (PASS, or FAIL with the worst element) and exits 1 if any failed.
// The thread pool it hands the kernels says it has kPoolThreads threads, so the kernels share
// their items with that many helpers less one (parallel_for.h), as under XLA.
//
// The case file, little-endian: "JXCK", u32 cases, then per case: str name, str handler,
// u32 args {i32 dtype, u32 rank, i64 dims[rank], u64 bytes, data}, u32 attrs sorted by name
// {str name, i32 dtype (S64 or F32), 8 bytes (an int64, or a float in the first 4)}, u32 rets
// {i32 dtype, u32 rank, i64 dims[rank], u64 bytes, reference data, f64 atol, f64 rtol}. A str is
// u32 length + bytes; dtypes are XLA_FFI_DataType values. Results are compared as f32 within
// atol + rtol * |reference|, or as s32 exactly.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxservePagedDecode(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxserveInt8Matmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxserveInt8WeightMatmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxserveF32Matmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxserveBlockMatmul(XLA_FFI_CallFrame*);
int JaxserveMatmulVectorized();
int JaxserveBlocksVectorized();
int JaxserveTilesVectorized();
}

namespace {

// The few parts of XLA's FFI API the kernels use: errors, and a thread pool's size (they schedule
// nothing on it: parallel_for.h runs helper threads of its own).
struct XLA_FFI_Error_Impl {
  std::string message;
};

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* args) {
  return reinterpret_cast<XLA_FFI_Error*>(new XLA_FFI_Error_Impl{args->message});
}

void ErrorGetMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = reinterpret_cast<XLA_FFI_Error_Impl*>(args->error)->message.c_str();
}

void ErrorDestroy(XLA_FFI_Error_Destroy_Args* args) { delete reinterpret_cast<XLA_FFI_Error_Impl*>(args->error); }

constexpr int64_t kPoolThreads = 3;  // two helpers: more interleavings than one

XLA_FFI_Error* NumThreads(XLA_FFI_ThreadPool_NumThreads_Args* args) {
  *args->num_threads = kPoolThreads;
  return nullptr;
}

XLA_FFI_Api MakeApi() {
  XLA_FFI_Api api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = ErrorCreate;
  api.XLA_FFI_Error_GetMessage = ErrorGetMessage;
  api.XLA_FFI_Error_Destroy = ErrorDestroy;
  api.XLA_FFI_ThreadPool_NumThreads = NumThreads;
  return api;
}

struct Reader {
  const std::vector<char>& bytes;
  size_t at = 0;
  template <typename T>
  T Get() {
    if (at + sizeof(T) > bytes.size()) throw std::runtime_error("the case file ends early");
    T v;
    std::memcpy(&v, bytes.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string Str() {
    const uint32_t n = Get<uint32_t>();
    if (at + n > bytes.size()) throw std::runtime_error("the case file ends early");
    std::string s(bytes.data() + at, n);
    at += n;
    return s;
  }
  std::vector<char> Data(uint64_t n) {
    if (at + n > bytes.size()) throw std::runtime_error("the case file ends early");
    std::vector<char> d(bytes.begin() + at, bytes.begin() + at + n);
    at += n;
    return d;
  }
};

struct Buffer {
  XLA_FFI_Buffer ffi;
  std::vector<int64_t> dims;
  std::vector<char> data, want;
  double atol = 0, rtol = 0;
};

void ReadBuffer(Reader& r, Buffer& b, bool ret) {
  b.ffi.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
  b.ffi.extension_start = nullptr;
  b.ffi.dtype = static_cast<XLA_FFI_DataType>(r.Get<int32_t>());
  b.dims.resize(r.Get<uint32_t>());
  for (auto& d : b.dims) d = r.Get<int64_t>();
  const uint64_t n = r.Get<uint64_t>();
  if (ret) {
    b.want = r.Data(n);
    b.data.assign(n, 0);
    b.atol = r.Get<double>();
    b.rtol = r.Get<double>();
  } else {
    b.data = r.Data(n);
  }
  b.ffi.rank = static_cast<int64_t>(b.dims.size());
  b.ffi.dims = b.dims.data();
  b.ffi.data = b.data.data();
}

// "" if every element of `b` is within its bounds; else the worst one.
std::string Compare(const Buffer& b) {
  if (b.ffi.dtype == XLA_FFI_DataType_S32) {
    const auto* got = reinterpret_cast<const int32_t*>(b.data.data());
    const auto* want = reinterpret_cast<const int32_t*>(b.want.data());
    for (size_t i = 0; i < b.data.size() / 4; ++i) {
      if (got[i] != want[i]) return "element " + std::to_string(i) + ": " + std::to_string(got[i]) + " != " + std::to_string(want[i]);
    }
    return "";
  }
  const auto* got = reinterpret_cast<const float*>(b.data.data());
  const auto* want = reinterpret_cast<const float*>(b.want.data());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < b.data.size() / 4; ++i) {
    const double miss = std::fabs(double(got[i]) - double(want[i])) / (b.atol + b.rtol * std::fabs(double(want[i])));
    if (!(miss <= worst)) worst = miss, at = i;  // NaN counts as the worst
  }
  if (worst <= 1.0) return "";
  char msg[160];
  std::snprintf(msg, sizeof(msg), "element %zu: %.8g against %.8g (%.3g x the bound)", at, got[at], want[at], worst);
  return msg;
}

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

Handler Find(const std::string& name) {
  if (name == "JaxservePagedDecode") return JaxservePagedDecode;
  if (name == "JaxserveInt8Matmul") return JaxserveInt8Matmul;
  if (name == "JaxserveInt8WeightMatmul") return JaxserveInt8WeightMatmul;
  if (name == "JaxserveF32Matmul") return JaxserveF32Matmul;
  if (name == "JaxserveBlockMatmul") return JaxserveBlockMatmul;
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASES\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const XLA_FFI_Api api = MakeApi();
  std::printf("vector paths: matmul %d, blocks %d, tiles %d\n", JaxserveMatmulVectorized(),
              JaxserveBlocksVectorized(), JaxserveTilesVectorized());
  int failed = 0;
  try {
    Reader r{bytes};
    if (bytes.size() < 4 || std::memcmp(bytes.data(), "JXCK", 4) != 0) throw std::runtime_error("not a case file");
    r.at = 4;
    const uint32_t cases = r.Get<uint32_t>();
    for (uint32_t c = 0; c < cases; ++c) {
      const std::string name = r.Str(), handler_name = r.Str();
      std::vector<Buffer> args(r.Get<uint32_t>());
      for (auto& b : args) ReadBuffer(r, b, false);
      const uint32_t nattrs = r.Get<uint32_t>();
      std::vector<std::string> attr_names(nattrs);
      std::vector<XLA_FFI_ByteSpan> spans(nattrs);
      std::vector<XLA_FFI_ByteSpan*> span_ptrs(nattrs);
      std::vector<XLA_FFI_Scalar> scalars(nattrs);
      std::vector<int64_t> values(nattrs);
      std::vector<XLA_FFI_AttrType> attr_types(nattrs, XLA_FFI_AttrType_SCALAR);
      std::vector<void*> attr_ptrs(nattrs);
      for (uint32_t i = 0; i < nattrs; ++i) {
        attr_names[i] = r.Str();
        const auto dtype = static_cast<XLA_FFI_DataType>(r.Get<int32_t>());
        values[i] = r.Get<int64_t>();
        scalars[i] = {dtype, &values[i]};
      }
      for (uint32_t i = 0; i < nattrs; ++i) {
        spans[i] = {attr_names[i].data(), attr_names[i].size()};
        span_ptrs[i] = &spans[i];
        attr_ptrs[i] = &scalars[i];
      }
      std::vector<Buffer> rets(r.Get<uint32_t>());
      for (auto& b : rets) ReadBuffer(r, b, true);
      std::vector<XLA_FFI_ArgType> arg_types(args.size(), XLA_FFI_ArgType_BUFFER);
      std::vector<XLA_FFI_RetType> ret_types(rets.size(), XLA_FFI_RetType_BUFFER);
      std::vector<void*> arg_ptrs, ret_ptrs;
      for (auto& b : args) arg_ptrs.push_back(&b.ffi);
      for (auto& b : rets) ret_ptrs.push_back(&b.ffi);

      XLA_FFI_CallFrame frame;
      std::memset(&frame, 0, sizeof(frame));
      frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
      frame.api = &api;
      frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
      frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(args.size()), arg_types.data(), arg_ptrs.data()};
      frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(rets.size()), ret_types.data(), ret_ptrs.data()};
      frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(nattrs), attr_types.data(), span_ptrs.data(),
                     attr_ptrs.data()};
      std::string problem;
      if (Handler h = Find(handler_name)) {
        if (XLA_FFI_Error* err = h(&frame)) {
          problem = "the kernel refused: " + reinterpret_cast<XLA_FFI_Error_Impl*>(err)->message;
          delete reinterpret_cast<XLA_FFI_Error_Impl*>(err);
        }
      } else {
        problem = "no kernel " + handler_name;
      }
      for (size_t i = 0; i < rets.size() && problem.empty(); ++i) {
        const std::string miss = Compare(rets[i]);
        if (!miss.empty()) problem = "result " + std::to_string(i) + ", " + miss;
      }
      std::printf("%s %s%s%s\n", problem.empty() ? "PASS" : "FAIL", name.c_str(), problem.empty() ? "" : ": ",
                  problem.c_str());
      failed += !problem.empty();
    }
  } catch (const std::exception& e) {
    std::printf("FAIL reading %s: %s\n", argv[1], e.what());
    return 1;
  }
  std::printf("%d failed\n", failed);
  return failed ? 1 : 0;
}

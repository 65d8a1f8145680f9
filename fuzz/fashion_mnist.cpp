// Fuzzes the Fashion-MNIST IDX reader (runtime/fashion_mnist.cpp) through its public entry point.
// Input: one flags byte (bit 0: images file written without gzip, bit 1: the same for labels),
// two bytes (little-endian) giving the length of the image file's contents, that many bytes,
// then the label file's contents. The harness writes both files (gzip-compressed unless the flag
// says otherwise) into a private temporary folder and loads them: the loader must either throw
// std::runtime_error or return a consistent data set.
#include "ferry/runtime/fashion_mnist.hpp"

#include <unistd.h>
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "fuzz_support.hpp"

namespace {

using ferry::fuzz::check;

// The folder the inputs are written to as Fashion-MNIST files, removed when the fuzzer exits.
struct InputFolder {
  std::filesystem::path dir;
  InputFolder() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-fuzz-idx-XXXXXX").string();
    check(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  ~InputFolder() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

const std::filesystem::path& folder() {
  static const InputFolder input;
  return input.dir;
}

void write(const std::filesystem::path& file, const std::uint8_t* data, std::size_t size, bool raw) {
  if (raw) {
    std::FILE* f = std::fopen(file.c_str(), "wb");
    check(f != nullptr);
    check(std::fwrite(data, 1, size, f) == size);
    std::fclose(f);
    return;
  }
  gzFile gz = gzopen(file.c_str(), "wb1");
  check(gz != nullptr);
  if (size > 0) check(gzwrite(gz, data, static_cast<unsigned>(size)) == static_cast<int>(size));
  gzclose(gz);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return -1;
  const unsigned flags = data[0];
  std::size_t image_bytes = data[1] | (std::size_t{data[2]} << 8);
  data += 3;
  size -= 3;
  if (image_bytes > size) image_bytes = size;
  write(folder() / "t10k-images-idx3-ubyte.gz", data, image_bytes, flags & 1u);
  write(folder() / "t10k-labels-idx1-ubyte.gz", data + image_bytes, size - image_bytes, flags & 2u);
  try {
    const ferry::Dataset ds = ferry::load_fashion_mnist(folder(), ferry::Split::test);
    check(ds.count > 0 && ds.rows > 0 && ds.cols > 0);
    check(ds.labels.size() == ds.count);
    check(ds.images.size() == ds.count * ds.rows * ds.cols);
    for (auto l : ds.labels) check(l >= 0 && l < 10);
    for (float p : ds.images) check(p >= 0.0f && p <= 1.0f);
  } catch (const std::runtime_error&) {
  }
  return 0;
}

// IDX files, the format of MNIST and Fashion-MNIST: a big-endian header
// (0x00 0x00, element type 0x08 = unsigned byte, number of dimensions, then
// each dimension as a 32-bit integer) followed by the elements. An images
// file has dimensions [count, rows, cols], a labels file [count]. Files may
// be gzipped (detected by their first bytes, read through zlib).
//
// Images are fixed-size records, so a worker need not hold the training set:
// an uncompressed file is read with pread, record by record, as batches ask
// for examples. A gzipped file cannot be seeked, so it is inflated once into
// memory as bytes (a quarter of the floats it becomes). Pixels are scaled to
// [0, 1] as each batch is gathered.
#ifndef PSTRAIN_WORKER_IDX_DATA_H_
#define PSTRAIN_WORKER_IDX_DATA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/data.h"

namespace pstrain {

// Opens an images file and its labels file. Everything is checked before
// this returns: magic numbers, dimensions, that the data is exactly as long
// as the header says (truncation, trailing bytes), gzip integrity, that
// both files hold the same number of examples, and every label against
// num_classes (0: inferred as the largest label + 1). Errors are one line
// naming the file and what is wrong.
absl::StatusOr<std::unique_ptr<ExampleSource>> OpenIdx(
    const std::string& images_path, const std::string& labels_path,
    int64_t num_classes);

// The four files of an MNIST-layout data set in `dir`
// (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
// t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]); the gzipped
// name is taken when both exist. NotFound names the directory and the file
// missing.
struct IdxDataset {
  std::string train_images, train_labels, test_images, test_labels;
};
absl::StatusOr<IdxDataset> FindIdxDataset(const std::string& dir);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_IDX_DATA_H_

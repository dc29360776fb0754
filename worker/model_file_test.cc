#include "worker/model_file.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

ModelSchema TwoTensorsOneTable() {
  ModelSchema schema;
  schema.set_seed(3);
  schema.set_block_elements(4);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("fc0/weight");
  w->add_shape(2);
  w->add_shape(3);
  DenseTensorSpec* b = schema.add_dense();
  b->set_name("fc0/bias");
  b->add_shape(3);
  SparseTableSpec* table = schema.add_sparse();
  table->set_name("emb");
  table->set_dim(2);
  return schema;
}

ModelSnapshot Snapshot() {
  ModelSnapshot snapshot;
  snapshot.schema = TwoTensorsOneTable();
  snapshot.step = 7;
  snapshot.dense = {{1, 2, 3, 4, 5, 6}, {-1, -2, -3}};
  // Rows in the servers' (hash) order; the file sorts them by id.
  snapshot.sparse = {{{30, 10, 20}, {3, 3.5, 1, 1.5, 2, 2.5}}};
  return snapshot;
}

std::vector<DenseTensorSpec> Params(const ModelSchema& schema) {
  return {schema.dense().begin(), schema.dense().end()};
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

TEST(ModelFileTest, SnapshotBecomesTensorsRowsSortedByIdAndMetadata) {
  absl::StatusOr<SafetensorsFile> file = ModelFileFromSnapshot(Snapshot());
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors.size(), 4u);
  EXPECT_EQ(file->tensors[0].name, "fc0/weight");
  EXPECT_EQ(file->tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(file->Find("emb/ids")->AsU64(),
            (std::vector<uint64_t>{10, 20, 30}));
  EXPECT_EQ(file->Find("emb/rows")->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(file->Find("emb/rows")->AsF32(),
            (std::vector<float>{1, 1.5, 2, 2.5, 3, 3.5}));
  EXPECT_EQ(file->metadata.at("format"), "pstrain");
  EXPECT_EQ(file->metadata.at("step"), "7");
  EXPECT_THAT(file->metadata.at("schema"), HasSubstr("\"fc0/bias\""));
}

TEST(ModelFileTest, SnapshotThatDoesNotFitItsSchemaIsRefused) {
  ModelSnapshot snapshot = Snapshot();
  snapshot.dense[1].pop_back();
  EXPECT_FALSE(ModelFileFromSnapshot(snapshot).ok());
  snapshot = Snapshot();
  snapshot.sparse[0].ids[1] = 30;  // twice
  EXPECT_FALSE(ModelFileFromSnapshot(snapshot).ok());
}

TEST(ModelFileTest, LoadsTheDenseTensorsOfAFileWithoutTables) {
  ModelSnapshot snapshot = Snapshot();
  snapshot.schema.clear_sparse();
  snapshot.sparse.clear();
  const std::string path = TempPath("dense.safetensors");
  ASSERT_TRUE(
      WriteSafetensorsFile(path, *ModelFileFromSnapshot(snapshot)).ok());
  absl::StatusOr<std::vector<std::vector<float>>> values =
      LoadModelFile(path, Params(snapshot.schema));
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, snapshot.dense);
}

TEST(ModelFileTest, EveryMismatchNamesTheFileAndTheTensor) {
  const ModelSchema schema = TwoTensorsOneTable();
  const std::string path = TempPath("model.safetensors");
  auto load_error = [&](const SafetensorsFile& file) {
    EXPECT_TRUE(WriteSafetensorsFile(path, file).ok());
    absl::StatusOr<std::vector<std::vector<float>>> values =
        LoadModelFile(path, Params(schema));
    EXPECT_FALSE(values.ok());
    EXPECT_THAT(values.status().message(), HasSubstr(path));
    return std::string(values.status().message());
  };
  const std::vector<float> six = {1, 2, 3, 4, 5, 6};
  const std::vector<int64_t> six_ids = {1, 2, 3, 4, 5, 6};
  SafetensorsFile file;
  file.tensors = {SafetensorsTensor::F32("fc0/weight", {2, 3}, six)};
  EXPECT_THAT(load_error(file), HasSubstr("tensor 'fc0/bias' is missing"));

  file.tensors = {SafetensorsTensor::F32("fc0/weight", {3, 2}, six),
                  SafetensorsTensor::F32("fc0/bias", {3}, {1, 2, 3})};
  EXPECT_THAT(load_error(file),
              HasSubstr("'fc0/weight' has shape [3, 2] but this model needs "
                        "[2, 3]"));

  file.tensors = {SafetensorsTensor::I64("fc0/weight", {2, 3}, six_ids),
                  SafetensorsTensor::F32("fc0/bias", {3}, {1, 2, 3})};
  EXPECT_THAT(load_error(file), HasSubstr("'fc0/weight' is I64, expected F32"));

  file.tensors = {SafetensorsTensor::F32("fc0/weight", {2, 3}, six),
                  SafetensorsTensor::F32("fc0/bias", {3}, {1, 2, 3}),
                  SafetensorsTensor::F32("fc9/bias", {1}, {1})};
  EXPECT_THAT(load_error(file),
              HasSubstr("'fc9/bias' is not a parameter of this model"));
}

}  // namespace
}  // namespace pstrain

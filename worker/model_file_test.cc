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

// The bytes of `snapshot`'s model file: equal bytes, equal models.
std::string FileBytes(const ModelSnapshot& snapshot) {
  absl::StatusOr<SafetensorsFile> file = ModelFileFromSnapshot(snapshot);
  EXPECT_TRUE(file.ok()) << file.status();
  absl::StatusOr<std::string> bytes = SerializeSafetensors(*file);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.value_or("");
}

TEST(ModelFileTest, AFileReadsBackAsItsSnapshot) {
  const std::string path = TempPath("read_back.safetensors");
  ASSERT_TRUE(
      WriteSafetensorsFile(path, *ModelFileFromSnapshot(Snapshot())).ok());
  absl::StatusOr<ModelSnapshot> read = ReadModelSnapshot(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->step, 7);
  EXPECT_EQ(FileBytes(*read), FileBytes(Snapshot()));
}

// Two deltas (a row changed, one added, one evicted; a dense tensor
// changed, one not) applied in order to the base give the last model's file
// byte for byte, and hold only what changed.
TEST(ModelFileTest, DeltasAppliedInOrderGiveTheLastModelExactly) {
  const ModelSnapshot base = Snapshot();
  ModelSnapshot second = base;
  second.step = 9;
  second.dense[1] = {-1, -2, -3.5};
  second.sparse[0] = {{40, 30, 10, 20}, {4, 4, 3, 3.5, 1, 1.25, 2, 2.5}};
  ModelSnapshot third = second;
  third.step = 12;
  third.sparse[0] = {{40, 10, 20}, {4, 4, 1, 1.25, 2, 2.75}};  // 30 evicted

  absl::StatusOr<SafetensorsFile> first_delta = ModelDelta(base, second);
  ASSERT_TRUE(first_delta.ok()) << first_delta.status();
  EXPECT_EQ(first_delta->Find("fc0/weight"), nullptr);  // unchanged
  EXPECT_EQ(first_delta->Find("fc0/bias")->AsF32(),
            (std::vector<float>{-1, -2, -3.5}));
  EXPECT_EQ(first_delta->Find("emb/ids")->AsU64(),
            (std::vector<uint64_t>{10, 40}));
  EXPECT_TRUE(first_delta->Find("emb/deleted_ids")->AsU64().empty());
  absl::StatusOr<SafetensorsFile> second_delta = ModelDelta(second, third);
  ASSERT_TRUE(second_delta.ok()) << second_delta.status();
  EXPECT_EQ(second_delta->Find("fc0/bias"), nullptr);
  EXPECT_EQ(second_delta->Find("emb/ids")->AsU64(),
            (std::vector<uint64_t>{20}));
  EXPECT_EQ(second_delta->Find("emb/deleted_ids")->AsU64(),
            (std::vector<uint64_t>{30}));

  absl::StatusOr<ModelSnapshot> applied =
      ApplyModelDelta(base, *first_delta, "d1");
  ASSERT_TRUE(applied.ok()) << applied.status();
  applied = ApplyModelDelta(*applied, *second_delta, "d2");
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->step, 12);
  EXPECT_EQ(FileBytes(*applied), FileBytes(third));
}

TEST(ModelFileTest, ADeltaOfAnotherBaseOrModelIsRefusedNamingIt) {
  const ModelSnapshot base = Snapshot();
  ModelSnapshot later = base;
  later.step = 9;
  later.dense[0][0] = 100;
  absl::StatusOr<SafetensorsFile> delta = ModelDelta(base, later);
  ASSERT_TRUE(delta.ok()) << delta.status();
  // Out of order: applied to the later model instead of its base.
  absl::StatusOr<ModelSnapshot> wrong = ApplyModelDelta(later, *delta, "d1");
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(),
              HasSubstr("d1 was taken from a base at step 7, this model is at "
                        "step 9"));
  ModelSnapshot other = base;
  other.schema.set_seed(4);
  wrong = ApplyModelDelta(other, *delta, "d1");
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(),
              HasSubstr("d1 is a delta of another model (seed"));
  EXPECT_THAT(ModelDelta(other, later).status().message(),
              HasSubstr("the base is a file of another model"));
  EXPECT_THAT(ModelDelta(later, base).status().message(),
              HasSubstr("the base is at step 9, after the model's step 7"));
}

}  // namespace
}  // namespace pstrain

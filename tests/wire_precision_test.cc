// Low precision on the wire both ways, against real servers: parameters
// pulled as bfloat16 or fp16 are the servers' float32 values rounded by the
// wire codec (the servers keep float32), STATE tensors come exactly, a
// caller may hand over or take the 16-bit elements itself (a GPU worker
// casts on its device), and a caller's mistakes are refused before anything
// is sent. Then whole jobs: a worker that casts on its "device"
// (--device=cpu_staged) trains exactly the model of one whose client casts
// on the host.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/transport/tensor_codec.h"
#include "gtest/gtest.h"
#include "proto/ps.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::TestCluster;

constexpr int64_t kWeights = 1000;
constexpr int64_t kStates = 8;

// "w": a PARAMETER of random values, 2 blocks per shard; "running": a
// STATE tensor (BatchNorm's statistics) of random values too. With large
// blocks (`weights` elements in blocks of 65536) a pull's payloads travel
// apart from its metadata on the data plane and land straight in the
// destination.
ModelSchema Schema(int64_t weights = kWeights, int64_t block_elements = 256) {
  ModelSchema schema;
  schema.set_seed(11);
  schema.set_block_elements(block_elements);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(weights);
  w->mutable_init()->set_kind(InitSpec::NORMAL);
  w->mutable_init()->set_scale(3.0f);
  DenseTensorSpec* running = schema.add_dense();
  running->set_name("running");
  running->add_shape(kStates);
  running->set_role(DenseTensorSpec::STATE);
  running->mutable_init()->set_kind(InitSpec::UNIFORM);
  running->mutable_init()->set_scale(1.0f);
  return schema;
}

float FromBf16Bits(uint16_t bits) { return Bfloat16BitsToFloat(bits); }

class WirePrecisionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClusterOptions options;
    options.num_shards = 2;
    options.num_workers = 1;
    // Async SGD at rate 1: a pushed gradient g moves each element by -g.
    options.mode = "async";
    options.server_flags = {"--optimizer=sgd", "--learning_rate=1"};
    absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
        TestCluster::Start(options, "wire_precision");
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  std::unique_ptr<PsClient> Client(DataType gradients, DataType parameters,
                                   int worker_id,
                                   const ModelSchema& schema = Schema()) {
    PsClientOptions options;
    options.hosts = cluster_->HostList();
    options.rpc_timeout = absl::Seconds(10);
    options.gradient_wire_type = gradients;
    options.parameter_wire_type = parameters;
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    absl::StatusOr<Registration> registered =
        (*client)->Register(schema, 1, worker_id);
    EXPECT_TRUE(registered.ok()) << registered.status();
    return std::move(*client);
  }

  // The servers' values, exactly (a float32 observer).
  std::vector<std::vector<float>> Exact(const ModelSchema& schema = Schema()) {
    std::unique_ptr<PsClient> observer = Client(FLOAT32, FLOAT32, -1, schema);
    std::vector<std::vector<float>> values = {
        std::vector<float>(schema.dense(0).shape(0)),
        std::vector<float>(kStates)};
    absl::StatusOr<int64_t> pulled =
        observer->Pull(0, {values[0].data(), values[1].data()});
    EXPECT_TRUE(pulled.ok()) << pulled.status();
    return values;
  }

  std::unique_ptr<TestCluster> cluster_;
};

TEST_F(WirePrecisionTest, ParametersComeRoundedAndStateExactly) {
  const std::vector<std::vector<float>> exact = Exact();
  for (DataType type : {BFLOAT16, FLOAT16}) {
    SCOPED_TRACE(DataType_Name(type));
    std::unique_ptr<PsClient> client = Client(FLOAT32, type, -1);
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(client->PullWireType(0), type);
    EXPECT_EQ(client->PullWireType(1), FLOAT32);
    std::vector<float> w(kWeights), running(kStates);
    ASSERT_TRUE(client->Pull(0, {w.data(), running.data()}).ok());
    int64_t rounded_away = 0;
    for (int64_t i = 0; i < kWeights; ++i) {
      const float expected =
          type == BFLOAT16 ? FromBf16Bits(FloatToBfloat16Bits(exact[0][i]))
                           : HalfBitsToFloat(FloatToHalfBits(exact[0][i]));
      ASSERT_EQ(w[i], expected) << "element " << i << " of " << exact[0][i];
      if (w[i] != exact[0][i]) ++rounded_away;
    }
    // N(0, 9) values are almost never representable in 16 bits: the
    // rounding happened (a server sending float32 would fail here).
    EXPECT_GT(rounded_away, kWeights * 9 / 10);
    EXPECT_EQ(running, exact[1]);
  }
}

TEST_F(WirePrecisionTest, SixteenBitDestinationsGetTheWireBits) {
  const std::vector<std::vector<float>> exact = Exact();
  std::unique_ptr<PsClient> client = Client(BFLOAT16, BFLOAT16, -1);
  ASSERT_NE(client, nullptr);
  std::vector<uint16_t> w(kWeights);
  std::vector<float> running(kStates);
  ASSERT_TRUE(
      client
          ->PullTensors(
              0, std::vector<PsClient::TensorRef>{{BFLOAT16, w.data()},
                                                  {FLOAT32, running.data()}})
          .ok());
  for (int64_t i = 0; i < kWeights; ++i) {
    ASSERT_EQ(w[i], FloatToBfloat16Bits(exact[0][i])) << "element " << i;
  }
  EXPECT_EQ(running, exact[1]);
}

// Large blocks: the 16-bit payloads land straight in 16-bit destinations,
// and a PushPull of 16-bit gradients brings the updated model back as bf16.
TEST_F(WirePrecisionTest, LargeBlocksLandInSixteenBitsAsTheyCome) {
  constexpr int64_t kBig = 300000;
  const ModelSchema schema = Schema(kBig, 65536);
  const std::vector<std::vector<float>> before = Exact(schema);
  std::unique_ptr<PsClient> client = Client(BFLOAT16, BFLOAT16, 0, schema);
  ASSERT_NE(client, nullptr);
  std::vector<uint16_t> w(kBig);
  std::vector<float> running(kStates);
  const std::vector<PsClient::TensorRef> into = {{BFLOAT16, w.data()},
                                                 {FLOAT32, running.data()}};
  ASSERT_TRUE(client->PullTensors(0, into).ok());
  for (int64_t i = 0; i < kBig; ++i) {
    ASSERT_EQ(w[i], FloatToBfloat16Bits(before[0][i])) << "element " << i;
  }
  std::vector<uint16_t> gradient(kBig, FloatToBfloat16Bits(0.25f));
  absl::StatusOr<PsClient::PushPullResult> done = client->PushPullTensors(
      1, {{BFLOAT16, gradient.data()}, {FLOAT32, running.data()}}, 2, into);
  ASSERT_TRUE(done.ok()) << done.status();
  const std::vector<std::vector<float>> after = Exact(schema);
  for (int64_t i = 0; i < kBig; ++i) {
    ASSERT_EQ(after[0][i], before[0][i] - 0.25f) << "element " << i;
    ASSERT_EQ(w[i], FloatToBfloat16Bits(after[0][i])) << "element " << i;
  }
}

// The pipelined step's exchange streams the 16-bit gradients a device
// cast: each group leaves once its gradient is marked ready. This caller
// never says it stopped reading pulled values, which the plain PushPull the
// exchange falls back to waits for (until the call's deadline, failing).
TEST_F(WirePrecisionTest, SixteenBitGradientsStreamAsTheyAreMade) {
  std::unique_ptr<PsClient> client = Client(BFLOAT16, BFLOAT16, 0);
  ASSERT_NE(client, nullptr);
  std::vector<uint16_t> w(kWeights);
  std::vector<float> running(kStates);
  const std::vector<PsClient::TensorRef> into = {{BFLOAT16, w.data()},
                                                 {FLOAT32, running.data()}};
  ASSERT_TRUE(client->PullTensors(0, into).ok());
  const std::vector<std::vector<float>> before = Exact();
  std::vector<uint16_t> bits(kWeights, FloatToBfloat16Bits(0.25f));
  std::vector<float> floats(kWeights, 0.25f);
  const std::vector<float> state = running;  // STATE: values, float32
  const std::vector<PsClient::ConstTensorRef> as_cast = {
      {BFLOAT16, bits.data()}, {FLOAT32, state.data()}};
  EXPECT_TRUE(client->StepsCanStream(as_cast));
  // float32 gradients would be converted when the calls are made, before
  // the gradients are.
  EXPECT_FALSE(client->StepsCanStream(
      {{FLOAT32, floats.data()}, {FLOAT32, state.data()}}));

  std::unique_ptr<PsClient::StepStream> stream = client->MakeStepStream();
  stream->BeginStep();
  stream->SetReady(0, kWeights);
  stream->SetReady(1, kStates);
  absl::StatusOr<PsClient::PushPullResult> done =
      client->PushPullStreamed(1, as_cast, 2, into, *stream);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(
      stream->WaitPulled(0, kWeights, absl::Now() + absl::Seconds(1)).ok());
  const std::vector<std::vector<float>> after = Exact();
  for (int64_t i = 0; i < kWeights; ++i) {
    ASSERT_EQ(after[0][i], before[0][i] - 0.25f) << "element " << i;
    ASSERT_EQ(w[i], FloatToBfloat16Bits(after[0][i])) << "element " << i;
  }
}

TEST_F(WirePrecisionTest, SixteenBitGradientsApplyAsTheHostWouldRoundThem) {
  std::unique_ptr<PsClient> client = Client(BFLOAT16, FLOAT32, 0);
  ASSERT_NE(client, nullptr);
  const std::vector<std::vector<float>> before = Exact();
  // The gradient's bf16 bits, made by the caller (as a GPU's cast would).
  std::vector<float> gradient(kWeights);
  std::vector<uint16_t> bits(kWeights);
  for (int64_t i = 0; i < kWeights; ++i) {
    gradient[i] = 0.001f * static_cast<float>(i) + 1.0f / 3.0f;
    bits[i] = FloatToBfloat16Bits(gradient[i]);
  }
  const std::vector<float> state(kStates, 0.5f);  // values, not gradients
  absl::StatusOr<PsClient::PushResult> pushed = client->PushTensors(
      1, std::vector<PsClient::ConstTensorRef>{{BFLOAT16, bits.data()},
                                               {FLOAT32, state.data()}});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  const std::vector<std::vector<float>> after = Exact();
  int64_t rounded = 0;
  for (int64_t i = 0; i < kWeights; ++i) {
    ASSERT_EQ(after[0][i], before[0][i] - FromBf16Bits(bits[i]))
        << "element " << i;
    if (FromBf16Bits(bits[i]) != gradient[i]) ++rounded;
  }
  EXPECT_GT(rounded, 0);
  EXPECT_EQ(after[1], state);
}

TEST_F(WirePrecisionTest, MismatchedElementTypesAreRefusedBeforeSending) {
  std::unique_ptr<PsClient> client = Client(BFLOAT16, BFLOAT16, 0);
  ASSERT_NE(client, nullptr);
  const std::vector<std::vector<float>> before = Exact();
  std::vector<uint16_t> w16(kWeights);
  std::vector<float> w(kWeights), running(kStates);
  std::vector<uint16_t> running16(kStates);

  // A STATE tensor travels as float32 whatever the wire type.
  absl::Status state_as_bf16 =
      client
          ->PullTensors(
              0, std::vector<PsClient::TensorRef>{{FLOAT32, w.data()},
                                                  {BFLOAT16, running16.data()}})
          .status();
  EXPECT_EQ(state_as_bf16.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(state_as_bf16.message().find(
                "Pull into 'running' as BFLOAT16: it comes as FLOAT32"),
            absl::string_view::npos)
      << state_as_bf16;

  // fp16 bits where the wire carries bf16.
  absl::Status fp16_push =
      client
          ->PushTensors(1,
                        std::vector<PsClient::ConstTensorRef>{
                            {FLOAT16, w16.data()}, {FLOAT32, running.data()}})
          .status();
  EXPECT_EQ(fp16_push.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(fp16_push.message().find(
                "Push of 'w' given as FLOAT16: it goes as BFLOAT16"),
            absl::string_view::npos)
      << fp16_push;

  // A float32 wire takes no 16-bit destination.
  std::unique_ptr<PsClient> exact_client = Client(FLOAT32, FLOAT32, -1);
  ASSERT_NE(exact_client, nullptr);
  absl::Status into_bf16 =
      exact_client
          ->PullTensors(
              0, std::vector<PsClient::TensorRef>{{BFLOAT16, w16.data()},
                                                  {FLOAT32, running.data()}})
          .status();
  EXPECT_EQ(into_bf16.code(), absl::StatusCode::kInvalidArgument);

  // Nothing reached the servers.
  EXPECT_EQ(Exact(), before);
}

// Whole jobs (real worker processes, sync, 2 workers x 2 shards): the
// worker on --device=cpu_staged stages its tensors as a GPU worker does,
// casting gradients to bf16 or fp16 and widening pulled 16-bit parameters
// in the backend; on --device=cpu the client converts on the host. The codec
// and the casts round alike, so the two train the same model to the bit, and
// one that pulls float32 trains another.
// Each worker's held-out loss and whether it cast on its device, from its
// final line.
std::string FinalLoss(const std::vector<std::string>& stdouts) {
  std::string losses;
  for (const std::string& out : stdouts) {
    for (const char* field : {"\"test_loss\":", "\"cast_on_device\":"}) {
      const size_t at = out.find(field);
      EXPECT_NE(at, std::string::npos) << out;
      if (at == std::string::npos) return "";
      absl::StrAppend(&losses, out.substr(at, out.find(',', at) - at), " ");
    }
  }
  return losses;
}

std::string RunJob(const std::string& name,
                   const std::vector<std::string>& flags) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = "sync";
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return "";
  std::vector<std::string> worker_flags = {
      "--data=synthetic",     "--model=mlp",
      "--hidden=64",          "--train_examples=2048",
      "--test_examples=512",  "--global_batch_size=64",
      "--steps=30",           "--log_every=0",
      "--block_elements=512", "--cpu_threads=1"};
  worker_flags.insert(worker_flags.end(), flags.begin(), flags.end());
  absl::StatusOr<std::vector<std::string>> outs =
      (*cluster)->RunWorkers({worker_flags, worker_flags}, absl::Seconds(120));
  EXPECT_TRUE(outs.ok()) << outs.status();
  if (!outs.ok()) return "";
  return FinalLoss(*outs);
}

TEST(WirePrecisionJobTest, CastingOnTheDeviceTrainsTheHostCodecsModel) {
  for (const std::string type : {"bf16", "fp16"}) {
    SCOPED_TRACE(type);
    const std::vector<std::string> sixteen = {"--gradient_wire_type=" + type,
                                              "--parameter_wire_type=" + type};
    std::vector<std::string> on_host = sixteen, on_device = sixteen;
    on_host.push_back("--device=cpu");
    on_device.push_back("--device=cpu_staged");
    const std::string host_loss = RunJob("wire_host_cast_" + type, on_host);
    const std::string device_loss =
        RunJob("wire_device_cast_" + type, on_device);
    const std::string fp32_loss =
        RunJob("wire_fp32_" + type,
               {"--device=cpu_staged", "--gradient_wire_type=" + type});
    ASSERT_FALSE(host_loss.empty());
    EXPECT_NE(host_loss.find("\"cast_on_device\":false"), std::string::npos);
    // The same losses; only where the cast happened differs.
    std::string expected = host_loss;
    for (size_t at; (at = expected.find("\"cast_on_device\":false")) !=
                    std::string::npos;) {
      expected.replace(at, std::strlen("\"cast_on_device\":false"),
                       "\"cast_on_device\":true");
    }
    EXPECT_EQ(device_loss, expected);
    EXPECT_NE(fp32_loss.substr(0, fp32_loss.find(' ')),
              host_loss.substr(0, host_loss.find(' ')));
  }
}

}  // namespace
}  // namespace pstrain

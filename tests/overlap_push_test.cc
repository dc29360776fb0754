// Pushing during backward, against real servers: a tensor reported ready by
// backward reaches the servers while backward is still going on (the other
// tensor not reported yet), not once backward is done. The servers run
// async with SGD at rate 1, so an applied gradient of ones moves every
// element of its tensor by exactly -1.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"
#include "worker/step_overlap.h"

namespace pstrain {
namespace {

std::vector<float> Minus(const std::vector<float>& a, float b) {
  std::vector<float> out = a;
  for (float& x : out) x -= b;
  return out;
}

TEST(OverlappedPushTest, AReadyTensorIsAppliedBeforeBackwardEnds) {
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.mode = "async";
  options.server_flags = {"--optimizer=sgd", "--learning_rate=1"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "overlap_push");
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  // Softmax regression, 6 features, 3 classes: fc0/weight [6, 3] (random
  // init) and fc0/bias [3] (zeros); small blocks so each spans both shards.
  auto backend =
      std::move(*kernels::CreateBackend(kernels::BackendOptions{"cpu"}));
  auto model = std::move(*CreateMlp(backend.get(), 6, {}, 3, 1));
  ModelSchema schema;
  schema.set_seed(3);
  schema.set_block_elements(4);
  for (const DenseTensorSpec& spec : model->Params()) {
    *schema.add_dense() = spec;
  }
  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  client_options.rpc_timeout = absl::Seconds(10);
  auto worker = std::move(*PsClient::Create(client_options));
  auto observer = std::move(*PsClient::Create(client_options));
  ASSERT_TRUE(worker->Register(schema, 1, /*worker_id=*/0).ok());
  ASSERT_TRUE(observer->Register(schema, 1, /*worker_id=*/-1).ok());

  std::vector<std::vector<float>> pulled = {std::vector<float>(18),
                                            std::vector<float>(3)};
  std::vector<float*> pulled_pointers = {pulled[0].data(), pulled[1].data()};
  ASSERT_TRUE(worker->Pull(0, pulled_pointers).ok());
  const std::vector<std::vector<float>> initial = pulled;

  // Gradients of ones in backend memory, and their host copies.
  std::vector<kernels::DeviceArray<float>> device_grads;
  std::vector<float*> device_pointers;
  std::vector<kernels::HostArray<float>> host_grads;
  for (size_t n : {size_t{18}, size_t{3}}) {
    host_grads.push_back(
        std::move(*kernels::HostArray<float>::Create(backend.get(), n)));
  }
  for (const kernels::HostArray<float>& host : host_grads) {
    device_grads.push_back(std::move(
        *kernels::DeviceArray<float>::Create(backend.get(), host.size())));
    const std::vector<float> ones(host.size(), 1.0f);
    ASSERT_TRUE(backend
                    ->CopyToDevice(ones.data(), device_grads.back().data(),
                                   device_grads.back().bytes())
                    .ok());
    device_pointers.push_back(device_grads.back().data());
  }

  OverlappedPush push(*worker, *backend, device_pointers, host_grads);
  push.Start(0);
  ASSERT_TRUE(push.Ready(1).ok());  // backward issued the bias's gradient
  // Backward goes on (the weight not reported yet): the bias must reach the
  // servers meanwhile. Polled through an observer, with a deadline.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (pulled[1] == initial[1] && absl::Now() < give_up) {
    ASSERT_TRUE(observer->Pull(0, pulled_pointers).ok());
    if (pulled[1] == initial[1]) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(pulled[1], Minus(initial[1], 1)) << "the bias was not pushed "
                                                "while backward went on";
  EXPECT_EQ(pulled[0], initial[0]) << "the weight went before it was ready";

  ASSERT_TRUE(push.Ready(0).ok());
  absl::StatusOr<PsClient::PushResult> result = push.Finish();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->blocks_duplicate, 0);
  EXPECT_GT(push.push_time(), absl::ZeroDuration());
  ASSERT_TRUE(observer->Pull(0, pulled_pointers).ok());
  EXPECT_EQ(pulled[0], Minus(initial[0], 1));
  EXPECT_EQ(pulled[1], Minus(initial[1], 1)) << "the bias applied once";
}

}  // namespace
}  // namespace pstrain

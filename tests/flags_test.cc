// A bad flag makes either binary exit non-zero with one line saying what
// and why, before it does anything else.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

struct FlagCase {
  std::string binary;
  std::vector<std::string> flags;
  std::string expected;  // in the one stderr line
};

void PrintTo(const FlagCase& c, std::ostream* os) {
  *os << c.binary;
  for (const std::string& flag : c.flags) *os << " " << flag;
}

class FlagsTest : public ::testing::TestWithParam<FlagCase> {};

TEST_P(FlagsTest, ExitsWithOneClearLine) {
  const FlagCase& c = GetParam();
  std::vector<std::string> argv = {testing::BinaryPath(c.binary)};
  argv.insert(argv.end(), c.flags.begin(), c.flags.end());
  absl::StatusOr<std::unique_ptr<testing::Process>> process =
      testing::Process::Start(argv, testing::TestDir(), "flags");
  ASSERT_TRUE(process.ok()) << process.status();
  absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  const std::string err = (*process)->Stderr();
  const std::vector<std::string> lines =
      absl::StrSplit(err, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 1u) << err;
  EXPECT_NE(err.find(c.expected), std::string::npos) << err;
}

// A port another process listens on, or a host that is not this machine's:
// one line naming it, before gRPC's own multi-line dump could.
TEST(FlagsTest, AnAddressThatCannotBeListenedOnIsOneLine) {
  const int in_use = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(in_use, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(
      ::bind(in_use, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(::listen(in_use, 1), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(
      ::getsockname(in_use, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::string port = std::to_string(ntohs(address.sin_port));
  for (const auto& [host, expected] :
       {std::pair<std::string, std::string>{"127.0.0.1",
                                            "Address already in use"},
        // TEST-NET-1 (RFC 5737): no machine's own address.
        std::pair<std::string, std::string>{"192.0.2.1", "cannot listen"}}) {
    absl::StatusOr<std::unique_ptr<testing::Process>> process =
        testing::Process::Start(
            {testing::BinaryPath("ps_server/ps_server"), "--host=" + host,
             "--port=" + port, "--shard_id=0", "--num_shards=1",
             "--num_workers=1"},
            testing::TestDir(), "port_in_use");
    ASSERT_TRUE(process.ok()) << process.status();
    absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 2) << host;
    const std::string err = (*process)->Stderr();
    const std::vector<std::string> lines =
        absl::StrSplit(err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << err;
    EXPECT_NE(err.find("--host=" + host + " --port=" + port), std::string::npos)
        << err;
    EXPECT_NE(err.find(expected), std::string::npos) << err;
  }
  ::close(in_use);
}

// Asking for help is no error: exit 0, the usage once, this project's
// flags listed.
TEST(HelpTest, ExitsZeroWithUsage) {
  for (const std::string binary : {"ps_server/ps_server", "worker/worker"}) {
    const std::string name = binary.substr(binary.find('/') + 1);
    absl::StatusOr<std::unique_ptr<testing::Process>> process =
        testing::Process::Start({testing::BinaryPath(binary), "--help"},
                                testing::TestDir(), "help_" + name);
    ASSERT_TRUE(process.ok()) << process.status();
    absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << binary;
    const std::string out = (*process)->Stdout();
    EXPECT_EQ(out.rfind(name + ": ", 0), 0u) << out.substr(0, 200);
    EXPECT_EQ(out.find(name + ": " + name + ":"), std::string::npos)
        << out.substr(0, 200);
    EXPECT_NE(out.find("--metrics_port"), std::string::npos) << binary;
  }
}

INSTANTIATE_TEST_SUITE_P(
    BadFlags, FlagsTest,
    ::testing::Values(
        FlagCase{"ps_server/ps_server", {"--mode=bulk"}, "--mode must be"},
        FlagCase{"ps_server/ps_server", {"--port=70000"}, "--port must be"},
        FlagCase{"ps_server/ps_server",
                 {"--shard_id=2", "--num_shards=2"},
                 "--shard_id must be in [0, 2)"},
        FlagCase{"ps_server/ps_server",
                 {"--optimizer=lamb"},
                 "--optimizer must be sgd, momentum, adam or adamw"},
        FlagCase{"ps_server/ps_server",
                 {"--learning_rate=-1"},
                 "--learning_rate must be"},
        FlagCase{"ps_server/ps_server", {"stray"}, "unexpected argument"},
        FlagCase{"ps_server/ps_server",
                 {"--sync_sum_order=random"},
                 "--sync_sum_order must be worker_id or arrival"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_memory_gb=-1"},
                 "--sparse_memory_gb must be in [0, 1e6) (0: no limit)"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl=0s"},
                 "--sparse_row_ttl must be at least 1s (inf: rows never "
                 "expire), got 0"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl=30m", "--replicas=2",
                  "--replica_hosts=127.0.0.1:1,127.0.0.1:2"},
                 "--sparse_row_ttl cannot be used with --replicas > 1"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl_steps=-3"},
                 "--sparse_row_ttl_steps must be >= 1 (0: rows never "
                 "expire), got -3"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl_steps=100", "--sparse_row_ttl=30m"},
                 "--sparse_row_ttl_steps and --sparse_row_ttl: give one row "
                 "TTL"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl_steps=100", "--mode=async"},
                 "--sparse_row_ttl_steps counts the steps of sync tables; "
                 "--mode=async has none"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_row_ttl_steps=100", "--replicas=2",
                  "--replica_hosts=127.0.0.1:1,127.0.0.1:2"},
                 "--sparse_row_ttl_steps cannot be used with --replicas > 1"},
        FlagCase{"ps_server/ps_server",
                 {"--replica_catchup_chunk_kib=0"},
                 "--replica_catchup_chunk_kib must be in [1, 262144] (half of "
                 "--max_message_mb), got 0"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_max_rows=1000", "--replicas=2",
                  "--replica_hosts=127.0.0.1:1,127.0.0.1:2"},
                 "--sparse_max_rows and --sparse_memory_gb cannot be used "
                 "with --replicas > 1"},
        FlagCase{"ps_server/ps_server",
                 {"--sparse_memory_gb=1", "--replicas=2",
                  "--replica_hosts=127.0.0.1:1,127.0.0.1:2"},
                 "--sparse_max_rows and --sparse_memory_gb cannot be used "
                 "with --replicas > 1"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--inject_push_jitter_ms=-1"},
                 "--inject_push_jitter_ms must be"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--inject_crash_after_step=-2"},
                 "--inject_crash_after_step must be"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--model=ctr",
                  "--inject_crash_after_step=3"},
                 "--model=ctr does not run them"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--pulls_from_backups=true"},
                 "--pulls_from_backups must be by_host, always or never, got "
                 "'true'"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--pipeline_step=true"},
                 "--pipeline_step must be by_host, always or never, got "
                 "'true'"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=localhost:1", "--connections_per_shard=-1"},
                 "--connections_per_shard must be in [0, 64] (0: by host), "
                 "got -1"},
        FlagCase{"ps_server/ps_server",
                 {"--num_workers=2", "--min_workers=3"},
                 "--min_workers must be in [1, --num_workers=2]"},
        FlagCase{"ps_server/ps_server",
                 {"--startup_timeout_s=0"},
                 "--startup_timeout_s must be a positive number"},
        FlagCase{"ps_server/ps_server",
                 {"--grpc_max_frame_bytes=100"},
                 "--grpc_max_frame_bytes must be 0 or in [16384, 16777215]"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--grpc_stream_window_bytes=-5"},
                 "--grpc_stream_window_bytes must be in [0, "},
        FlagCase{"worker/worker", {}, "--ps_hosts is required"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--worker_id=3", "--num_workers=2"},
                 "--worker_id must be in [0, --num_workers=2)"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--model=cnn"},
                 "--model must be softmax, mlp, probe or ctr"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--hidden=32,x"},
                 "--hidden must be positive integers"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--device=tpu"},
                 "--device must be auto, cpu or cuda:N"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=nohostport"},
                 "--ps_hosts entries must be host:port"},
        FlagCase{"worker/worker",
                 {"--ps_hosts=a:1", "--data=csv"},
                 "--data=csv needs --train_file"}));

}  // namespace
}  // namespace pstrain

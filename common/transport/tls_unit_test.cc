// Start-up checks of the TLS files: every mistake is one error naming the
// flag. Certificates come from deploy/tls/make_certs.sh, run at test time.
#include <cstdlib>
#include <fstream>
#include <string>

#include "common/transport/tls.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

std::string TmpDir() { return std::getenv("TEST_TMPDIR"); }

// Generates a CA and certificates into TEST_TMPDIR/<name> once.
std::string Certs(const std::string& name) {
  const std::string dir = TmpDir() + "/" + name;
  const std::string script = std::string(std::getenv("TEST_SRCDIR")) +
                             "/pstrain/deploy/tls/make_certs.sh";
  const std::string command =
      "bash '" + script + "' '" + dir + "' localhost 127.0.0.1 2>/dev/null";
  if (std::system(command.c_str()) != 0) {
    ADD_FAILURE() << "failed: " << command;
  }
  return dir;
}

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = TmpDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

TEST(TlsFilesTest, ValidFilesMakeCredentials) {
  const std::string d = Certs("good");
  auto server = MakeServerCredentials(
      {d + "/server.pem", d + "/server.key", d + "/ca.pem"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_NE(*server, nullptr);
  auto client = MakeChannelCredentials(
      {d + "/ca.pem", d + "/client.pem", d + "/client.key", ""});
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_NE(*client, nullptr);
  auto named = MakeChannelCredentials({d + "/ca.pem", "", "", "localhost"});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_NE(*named, nullptr);
}

TEST(TlsFilesTest, NoFilesIsPlaintext) {
  auto server = MakeServerCredentials({});
  ASSERT_TRUE(server.ok());
  EXPECT_NE(*server, nullptr);  // InsecureServerCredentials
  auto client = MakeChannelCredentials({});
  ASSERT_TRUE(client.ok());
  EXPECT_EQ(*client, nullptr);  // PsClient: plaintext
}

TEST(TlsFilesTest, MistakesNameTheFlag) {
  const std::string d = Certs("mistakes");
  const std::string other = Certs("other");
  const std::string junk = Write("junk.pem", "not a pem\n");
  EXPECT_THAT(
      Message(MakeServerCredentials({d + "/server.pem", "", ""}).status()),
      HasSubstr("--tls_cert and --tls_key must be given together"));
  EXPECT_THAT(Message(MakeServerCredentials({"", "", d + "/ca.pem"}).status()),
              HasSubstr("--tls_client_ca needs --tls_cert and --tls_key"));
  EXPECT_THAT(
      Message(MakeServerCredentials({d + "/missing.pem", d + "/server.key", ""})
                  .status()),
      HasSubstr("--tls_cert=" + d + "/missing.pem: cannot read"));
  EXPECT_THAT(
      Message(MakeServerCredentials({junk, d + "/server.key", ""}).status()),
      HasSubstr("--tls_cert=" + junk + ": no PEM certificate"));
  EXPECT_THAT(
      Message(MakeServerCredentials({d + "/server.pem", junk, ""}).status()),
      HasSubstr("--tls_key=" + junk + ": no PEM private key"));
  EXPECT_THAT(Message(MakeServerCredentials(
                          {d + "/server.pem", other + "/server.key", ""})
                          .status()),
              HasSubstr("is not the key of --tls_cert"));
  EXPECT_THAT(Message(MakeServerCredentials(
                          {d + "/server.pem", d + "/server.key", junk})
                          .status()),
              HasSubstr("--tls_client_ca=" + junk + ": no PEM certificate"));
  EXPECT_THAT(Message(MakeChannelCredentials({junk, "", "", ""}).status()),
              HasSubstr("--tls_ca=" + junk));
  EXPECT_THAT(
      Message(MakeChannelCredentials({"", "", "", "localhost"}).status()),
      HasSubstr("--tls_server_name needs TLS"));
  EXPECT_THAT(
      Message(MakeChannelCredentials({d + "/ca.pem", d + "/client.pem", "", ""})
                  .status()),
      HasSubstr("must be given together"));
}

TEST(AuthTokenTest, ReadsOneWord) {
  EXPECT_EQ(*ReadAuthToken(""), "");
  EXPECT_EQ(*ReadAuthToken(Write("token", "s3cret-token\n")), "s3cret-token");
  EXPECT_THAT(Message(ReadAuthToken(Write("empty", " \n")).status()),
              HasSubstr("the file is empty"));
  EXPECT_THAT(Message(ReadAuthToken(Write("two", "a b\n")).status()),
              HasSubstr("one word"));
  EXPECT_THAT(Message(ReadAuthToken(TmpDir() + "/none").status()),
              HasSubstr("--auth_token_file=" + TmpDir() + "/none"));
}

}  // namespace
}  // namespace pstrain

// s3_credentials.h — where an S3 client's settings and credentials come from,
// found as the AWS SDKs find them, so that a trainer needs no configuration of
// its own on AWS, on EKS, on a spot instance or against a local store.
//
// Settings: the region (AWS_REGION, AWS_DEFAULT_REGION, the profile's `region`;
// default us-east-1) and the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the
// profile's `endpoint_url`; default AWS's own); the CA certificates for HTTPS
// (AWS_CA_BUNDLE, the profile's `ca_bundle`; default the system's).
//
// Credentials, the first source that has them, in the SDKs' order:
//   1. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN);
//   2. a web identity (EKS): AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN,
//      exchanged with STS (AssumeRoleWithWebIdentity; AWS_ENDPOINT_URL_STS);
//   3. the profile AWS_PROFILE (default "default") in ~/.aws/credentials and
//      ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE): role_arn
//      assumed (STS AssumeRole) with the credentials of source_profile or of
//      credential_source (Environment, Ec2InstanceMetadata, EcsContainer); static
//      keys; or web_identity_token_file with role_arn (a profile whose credential_source
//      is Environment comes before 1: the environment's keys are there to assume its role);
//   4. the container's credentials endpoint (ECS task roles, EKS Pod Identity):
//      AWS_CONTAINER_CREDENTIALS_RELATIVE_URI (on 169.254.170.2) or
//      AWS_CONTAINER_CREDENTIALS_FULL_URI (https, or http to a loopback or the
//      ECS/EKS agent's address), with AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE or
//      AWS_CONTAINER_AUTHORIZATION_TOKEN as its Authorization;
//   5. the EC2 instance metadata service, IMDSv2 (AWS_EC2_METADATA_SERVICE_ENDPOINT;
//      off with AWS_EC2_METADATA_DISABLED=true): a spot instance's role.
// Temporary credentials (2, 4, 5, and STS-issued ones) are fetched again from
// their source before they expire. A source that is configured but fails (an
// unreadable token file, a profile that does not exist, STS refusing the
// token) is an error naming it, not a silent fall-through to the next source.
// What may pass (no answer, a 5xx, STS throttling) is tried again with backoff
// before it is an error: a thousand ranks starting at once throttle STS.
// No message of this module ever contains a secret or a session token.
// Thread-safe.
#pragma once

#include "http.h"

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace zeroshard::ckpt::s3 {

// The variables the settings come from (a map, so that tests give their own).
using Environment = std::map<std::string, std::string>;
// This process's AWS_* variables and HOME.
Environment process_environment();

struct Credentials {
  std::string access_key_id, secret_access_key, session_token;
  // When temporary credentials stop working; none for static keys.
  std::optional<std::chrono::system_clock::time_point> expiration;
  std::string source;  // for messages: "environment", "profile 'ci' (/root/.aws/credentials)", ...
};

struct Settings {
  std::string region;        // never empty
  std::string s3_endpoint;   // "" for AWS (https://s3.REGION.amazonaws.com, virtual-hosted)
  std::string sts_endpoint;  // never empty
  std::string profile;       // the profile consulted ("default" unless AWS_PROFILE)
  std::string ca_bundle;     // AWS_CA_BUNDLE or the profile's ca_bundle: HTTPS's CA certificates ("" = the system's)
};
// REQUIRES: a profile named by AWS_PROFILE exists in one of the files (throws otherwise).
Settings settings_from(const Environment& env);

struct CredentialOptions {
  // Temporary credentials are fetched again this long before they expire. Default: 5 minutes.
  std::chrono::seconds refresh_before{300};
  // Each request to the metadata service or STS. Default: connect in 1 s, all of it in 5 s.
  http::Limits service_limits{std::chrono::milliseconds(1000), 1, std::chrono::milliseconds(5000),
                              std::chrono::milliseconds(5000)};
  // A fetch that may pass (no answer, 5xx, throttling) is tried this many times, waiting
  // backoff, 2 x backoff, ... (each from half to the whole of it) in between. Default: 5, from 0.25 s.
  int service_attempts = 5;
  std::chrono::milliseconds service_backoff{250};
  // The ECS agent, where AWS_CONTAINER_CREDENTIALS_RELATIVE_URI points.
  std::string container_endpoint = "http://169.254.170.2";
};

class CredentialChain {
 public:
  explicit CredentialChain(Environment env, CredentialOptions options = {});
  // The current credentials, fetched (the first time) or refreshed (near their
  // expiration) from the source that gave them. Throws, naming every source
  // tried and why each had none, when no source has credentials.
  Credentials get();
  // The store said the credentials with `access_key_id` expired or are invalid: the next get()
  // fetches anew, unless another thread has fetched others since.
  void expire(const std::string& access_key_id);
  const Settings& settings() const { return settings_; }
  // Where the current credentials came from ("" before the first get()).
  std::string source();

 private:
  enum class Source {
    kNone, kEnvironment, kWebIdentity, kProfileRole, kProfile, kProfileWebIdentity, kContainer, kMetadata
  };
  struct Profile {
    std::map<std::string, std::string> keys;  // the credentials file's over the config file's
    std::string where;                        // the files it was read from, for messages
    bool found = false;
    std::optional<std::string> value(const std::string& key) const;
  };
  // The first source with credentials (in the order above); sets source_.
  Credentials resolve();
  // One try; a failure that may pass throws TransientError (s3_credentials.cpp).
  Credentials fetch(Source source);
  // fetch(), tried again while it fails in a way that may pass.
  Credentials fetch_retrying(Source source);
  Credentials web_identity(const std::string& token_file, const std::string& role_arn, const std::string& session,
                           const std::string& where);
  // The profile's role_arn, assumed with its source_profile's or credential_source's credentials.
  Credentials assume_role(const std::string& profile_name, int depth);
  // An STS action's credentials (signed with `signer`'s, or unsigned when none).
  Credentials sts(const std::string& action, const std::string& form, const std::string& role_arn,
                  const std::string& where, const Credentials* signer);
  Credentials container();
  Credentials instance_metadata();
  Profile profile(const std::string& name) const;

  Environment env_;
  CredentialOptions options_;
  Settings settings_;
  std::string credentials_path_, config_path_;
  std::map<std::string, std::map<std::string, std::string>> credentials_file_, config_file_;
  Profile profile_;  // AWS_PROFILE's
  std::mutex mu_;                               // guards source_, current_
  Source source_ = Source::kNone;
  std::optional<Credentials> current_;
};

// "2026-11-29T18:04:05Z" (optionally with fractional seconds) as a time point; none if malformed.
std::optional<std::chrono::system_clock::time_point> parse_iso8601(const std::string& text);

}  // namespace zeroshard::ckpt::s3

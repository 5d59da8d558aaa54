// s3_credentials.cpp — the AWS default chain (s3_credentials.h).
#include "s3_credentials.h"

#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <pugixml.hpp>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <sstream>

extern char** environ;

namespace zeroshard::ckpt::s3 {

namespace {

using Clock = std::chrono::system_clock;

std::string env_var(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t\r\n");
  auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The sections of an AWS shared config or credentials file: "[name]" headers,
// "key = value" lines, '#' and ';' comments; an indented line continues the
// previous key's nested settings (kept out: they are other services' settings).
// Hand-written because the format's nesting and comments are not any INI dialect of
// the libraries we have (Boost.PropertyTree's INI reader refuses '#').
std::map<std::string, std::map<std::string, std::string>> read_aws_file(const std::string& path) {
  std::map<std::string, std::map<std::string, std::string>> sections;
  std::ifstream in(path);
  std::string line, section;
  while (std::getline(in, line)) {
    bool indented = !line.empty() && (line[0] == ' ' || line[0] == '\t');
    std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      section = trim(t.substr(1, t.size() - 2));
      sections[section];
      continue;
    }
    auto eq = t.find('=');
    if (indented || eq == std::string::npos || section.empty()) continue;
    sections[section][trim(t.substr(0, eq))] = trim(t.substr(eq + 1));
  }
  return sections;
}

std::string home_file(const Environment& env, const std::string& var, const std::string& name) {
  std::string path = env_var(env, var);
  if (!path.empty()) return path;
  std::string home = env_var(env, "HOME");
  return home.empty() ? "" : home + "/.aws/" + name;
}

bool truthy(const std::string& v) { return v == "true" || v == "TRUE" || v == "True" || v == "1"; }

std::string xml_child_text(const pugi::xml_node& node, const char* path) {
  return node.first_element_by_path(path).text().as_string();
}

}  // namespace

Environment process_environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string name = kv.substr(0, eq);
    if (name.rfind("AWS_", 0) == 0 || name == "HOME") env[name] = kv.substr(eq + 1);
  }
  return env;
}

std::optional<Clock::time_point> parse_iso8601(const std::string& text) {
  std::tm tm{};
  std::istringstream in(text);
  in >> std::get_time(&tm, "%Y-%m-%dT%H:%M:%S");
  if (in.fail()) return std::nullopt;
  std::string rest;
  std::getline(in, rest);
  if (!rest.empty() && rest[0] == '.') rest = rest.substr(std::min(rest.find_first_not_of("0123456789", 1), rest.size()));
  if (!(rest == "Z" || rest == "+00:00" || rest.empty())) return std::nullopt;
  return Clock::from_time_t(timegm(&tm));
}

Settings settings_from(const Environment& env) {
  Settings s;
  s.profile = env_var(env, "AWS_PROFILE").empty() ? "default" : env_var(env, "AWS_PROFILE");
  auto config = read_aws_file(home_file(env, "AWS_CONFIG_FILE", "config"));
  auto it = config.find(s.profile == "default" ? "default" : "profile " + s.profile);
  std::map<std::string, std::string> profile = it == config.end() ? std::map<std::string, std::string>{} : it->second;
  auto first = [&](std::initializer_list<std::string> vars, const std::string& key) {
    for (const auto& v : vars) {
      if (!env_var(env, v).empty()) return env_var(env, v);
    }
    auto p = profile.find(key);
    return p == profile.end() ? std::string() : p->second;
  };
  s.ca_bundle = first({"AWS_CA_BUNDLE"}, "ca_bundle");
  s.region = first({"AWS_REGION", "AWS_DEFAULT_REGION"}, "region");
  if (s.region.empty()) s.region = "us-east-1";
  s.s3_endpoint = first({"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}, "endpoint_url");
  s.sts_endpoint = first({"AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL"}, "endpoint_url");
  if (s.sts_endpoint.empty()) s.sts_endpoint = "https://sts." + s.region + ".amazonaws.com";
  while (!s.s3_endpoint.empty() && s.s3_endpoint.back() == '/') s.s3_endpoint.pop_back();
  while (s.sts_endpoint.back() == '/') s.sts_endpoint.pop_back();
  return s;
}

CredentialChain::CredentialChain(Environment env, CredentialOptions options)
    : env_(std::move(env)), options_(options), settings_(settings_from(env_)) {
  // The profile: the credentials file's section over the config file's.
  std::string creds_path = home_file(env_, "AWS_SHARED_CREDENTIALS_FILE", "credentials");
  std::string config_path = home_file(env_, "AWS_CONFIG_FILE", "config");
  auto creds = read_aws_file(creds_path);
  auto config = read_aws_file(config_path);
  const std::string& name = settings_.profile;
  auto c = config.find(name == "default" ? "default" : "profile " + name);
  if (c != config.end()) {
    profile_ = c->second;
    profile_where_ = config_path;
  }
  auto k = creds.find(name);
  if (k != creds.end()) {
    for (const auto& [key, value] : k->second) profile_[key] = value;
    profile_where_ = creds_path + (profile_where_.empty() ? "" : " and " + profile_where_);
  }
  TORCH_CHECK(env_var(env_, "AWS_PROFILE").empty() || c != config.end() || k != creds.end(), "S3 credentials: AWS_PROFILE=",
              name, " names a profile that neither ", creds_path, " nor ", config_path,
              " has; fix: add [", name, "] to the credentials file or [profile ", name,
              "] to the config file, or unset AWS_PROFILE");
}

std::optional<std::string> CredentialChain::profile_value(const std::string& key) const {
  auto it = profile_.find(key);
  if (it == profile_.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

Credentials CredentialChain::get() {
  std::lock_guard<std::mutex> lock(mu_);
  auto now = Clock::now();
  if (current_ && (!current_->expiration || now + options_.refresh_before < *current_->expiration)) return *current_;
  if (!current_) {
    current_ = resolve();
    return *current_;
  }
  try {
    current_ = fetch(source_);
  } catch (const std::exception& e) {
    // Still valid for a while: keep them and try again at the next request.
    if (now < *current_->expiration) {
      log_warn("S3 credentials from " + current_->source + " expire in " +
               std::to_string(std::chrono::duration_cast<std::chrono::seconds>(*current_->expiration - now).count()) +
               " s and could not be refreshed (" + error_message(e) + "); using them until then");
      return *current_;
    }
    throw;
  }
  return *current_;
}

void CredentialChain::expire(const std::string& access_key_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ && current_->access_key_id == access_key_id) current_->expiration = Clock::now();
}

Credentials CredentialChain::resolve() {
  std::string tried;
  for (Source s : {Source::kEnvironment, Source::kWebIdentity, Source::kProfile, Source::kProfileWebIdentity,
                   Source::kMetadata}) {
    Credentials c = fetch(s);  // a configured source that fails throws: an error of its own
    if (!c.access_key_id.empty()) {
      source_ = s;
      return c;
    }
    tried += "\n  " + c.source;  // why this source had none
  }
  TORCH_CHECK(false, "S3 credentials: none found. Tried, in order:", tried,
              "\nFix: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, set AWS_PROFILE to a profile with keys, "
              "or run where a role is attached (EKS web identity, an EC2 instance profile)");
}

// A source without credentials returns them empty with `source` saying why.
Credentials CredentialChain::fetch(Source source) {
  Credentials none;
  switch (source) {
    case Source::kEnvironment: {
      std::string id = env_var(env_, "AWS_ACCESS_KEY_ID"), secret = env_var(env_, "AWS_SECRET_ACCESS_KEY");
      TORCH_CHECK(id.empty() == secret.empty(), "S3 credentials: ", id.empty() ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID",
                  " is set but ", id.empty() ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY",
                  " is not; fix: export both (or neither)");
      if (id.empty()) {
        none.source = "environment: AWS_ACCESS_KEY_ID is not set";
        return none;
      }
      return {id, secret, env_var(env_, "AWS_SESSION_TOKEN"), std::nullopt, "environment (AWS_ACCESS_KEY_ID)"};
    }
    case Source::kWebIdentity: {
      std::string file = env_var(env_, "AWS_WEB_IDENTITY_TOKEN_FILE"), role = env_var(env_, "AWS_ROLE_ARN");
      if (file.empty() || role.empty()) {
        none.source = "web identity: AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN are not both set";
        return none;
      }
      return web_identity(file, role, env_var(env_, "AWS_ROLE_SESSION_NAME"), "AWS_WEB_IDENTITY_TOKEN_FILE");
    }
    case Source::kProfile: {
      auto id = profile_value("aws_access_key_id"), secret = profile_value("aws_secret_access_key");
      if (!id && !secret) {
        none.source = "profile '" + settings_.profile + "': " +
                      (profile_where_.empty() ? std::string("in no file under ~/.aws") : "no keys in " + profile_where_);
        for (const char* unsupported : {"credential_process", "sso_start_url", "sso_session", "source_profile"}) {
          TORCH_CHECK(!profile_value(unsupported) || profile_value("web_identity_token_file"), "S3 credentials: profile '",
                      settings_.profile, "' (", profile_where_, ") gets its credentials through '", unsupported,
                      "', which zeroshard does not run; fix: export the credentials it gives as AWS_ACCESS_KEY_ID, "
                      "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (e.g. `aws configure export-credentials "
                      "--format env`), or use a profile with keys");
        }
        return none;
      }
      TORCH_CHECK(id && secret, "S3 credentials: profile '", settings_.profile, "' (", profile_where_, ") has ",
                  id ? "aws_access_key_id but no aws_secret_access_key" : "aws_secret_access_key but no aws_access_key_id",
                  "; fix: give both");
      return {*id, *secret, profile_value("aws_session_token").value_or(""), std::nullopt,
              "profile '" + settings_.profile + "' (" + profile_where_ + ")"};
    }
    case Source::kProfileWebIdentity: {
      auto file = profile_value("web_identity_token_file"), role = profile_value("role_arn");
      if (!file || !role) {
        none.source = "profile '" + settings_.profile + "': no web_identity_token_file with role_arn";
        return none;
      }
      return web_identity(*file, *role, profile_value("role_session_name").value_or(""),
                          "profile '" + settings_.profile + "' web_identity_token_file");
    }
    case Source::kMetadata:
      if (truthy(env_var(env_, "AWS_EC2_METADATA_DISABLED"))) {
        none.source = "instance metadata: AWS_EC2_METADATA_DISABLED is set";
        return none;
      }
      return instance_metadata();
    case Source::kNone:
      break;
  }
  TORCH_CHECK(false, "S3 credentials: no source to refresh from");
}

Credentials CredentialChain::web_identity(const std::string& token_file, const std::string& role_arn,
                                          const std::string& session, const std::string& where) {
  std::ifstream in(token_file);
  TORCH_CHECK(in, "S3 credentials: the web identity token file '", token_file, "' (", where,
              ") cannot be read: ", std::strerror(errno), "; fix: mount the service account token there or unset it");
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  token = trim(token);
  TORCH_CHECK(!token.empty(), "S3 credentials: the web identity token file '", token_file, "' is empty");
  http::Request r;
  r.method = "POST";
  r.url = settings_.sts_endpoint + "/";
  r.headers = {"Content-Type: application/x-www-form-urlencoded"};
  r.ca_bundle = settings_.ca_bundle;
  r.body = "Action=AssumeRoleWithWebIdentity&Version=2011-06-15&RoleArn=" + http::uri_encode(role_arn, false) +
           "&RoleSessionName=" + http::uri_encode(session.empty() ? "zeroshard" : session, false) +
           "&WebIdentityToken=" + http::uri_encode(token, false);
  auto resp = http::perform(r, options_.service_limits);
  TORCH_CHECK(resp.status != 0, "S3 credentials: STS at ", settings_.sts_endpoint, " did not answer (",
              resp.transport_error, ") for the web identity of ", where, "; fix: check AWS_ENDPOINT_URL_STS or the network");
  pugi::xml_document doc;
  doc.load_string(resp.body.c_str());
  if (resp.status != 200) {
    TORCH_CHECK(false, "S3 credentials: STS refused AssumeRoleWithWebIdentity for role ", role_arn, " (", where, "): HTTP ",
                resp.status, " ", xml_child_text(doc, "ErrorResponse/Error/Code"), ": ",
                xml_child_text(doc, "ErrorResponse/Error/Message"));
  }
  auto creds = doc.first_element_by_path("AssumeRoleWithWebIdentityResponse/AssumeRoleWithWebIdentityResult/Credentials");
  Credentials c{creds.child("AccessKeyId").text().as_string(), creds.child("SecretAccessKey").text().as_string(),
                creds.child("SessionToken").text().as_string(), parse_iso8601(creds.child("Expiration").text().as_string()),
                "web identity (" + where + ", role " + role_arn + ", via STS)"};
  TORCH_CHECK(!c.access_key_id.empty() && !c.secret_access_key.empty() && c.expiration,
              "S3 credentials: STS's answer to AssumeRoleWithWebIdentity lacks AccessKeyId, SecretAccessKey or Expiration");
  return c;
}

Credentials CredentialChain::instance_metadata() {
  std::string endpoint = env_var(env_, "AWS_EC2_METADATA_SERVICE_ENDPOINT");
  if (endpoint.empty()) endpoint = "http://169.254.169.254";
  while (endpoint.back() == '/') endpoint.pop_back();
  Credentials none;
  http::Request t;
  t.method = "PUT";
  t.url = endpoint + "/latest/api/token";
  t.headers = {"X-aws-ec2-metadata-token-ttl-seconds: 21600"};
  t.no_proxy = true;  // link-local, and its answers are secrets
  auto token = http::perform(t, options_.service_limits);
  if (token.status == 0) {
    none.source = "instance metadata: " + endpoint + " did not answer (" + token.transport_error + ")";
    return none;
  }
  TORCH_CHECK(token.status == 200, "S3 credentials: the instance metadata service at ", endpoint,
              " refused an IMDSv2 session token: HTTP ", token.status);
  auto fetch = [&](const std::string& path) {
    http::Request g;
    g.url = endpoint + path;
    g.headers = {"X-aws-ec2-metadata-token: " + token.body};
    g.no_proxy = true;
    return http::perform(g, options_.service_limits);
  };
  auto roles = fetch("/latest/meta-data/iam/security-credentials/");
  if (roles.status == 404) {
    none.source = "instance metadata: no IAM role is attached to this instance";
    return none;
  }
  TORCH_CHECK(roles.status == 200 && !trim(roles.body).empty(), "S3 credentials: the instance metadata service at ",
              endpoint, " gave no role: HTTP ", roles.status, " ", roles.transport_error);
  std::string role = trim(roles.body.substr(0, roles.body.find('\n')));
  auto doc = fetch("/latest/meta-data/iam/security-credentials/" + role);
  TORCH_CHECK(doc.status == 200, "S3 credentials: the instance metadata service at ", endpoint,
              " gave no credentials for role '", role, "': HTTP ", doc.status, " ", doc.transport_error);
  auto j = nlohmann::json::parse(doc.body, nullptr, false);
  TORCH_CHECK(j.is_object() && j.value("Code", "") == "Success" && j.contains("AccessKeyId") &&
                  j.contains("SecretAccessKey") && j.contains("Expiration"),
              "S3 credentials: the instance metadata service's credentials for role '", role,
              "' are not a successful credentials document (Code: ",
              j.is_object() ? j.value("Code", "missing") : std::string("not JSON"), ")");
  auto expiration = parse_iso8601(j["Expiration"].get<std::string>());
  TORCH_CHECK(expiration, "S3 credentials: the instance metadata service's Expiration '",
              j["Expiration"].get<std::string>(), "' is not an ISO 8601 time");
  return {j["AccessKeyId"].get<std::string>(), j["SecretAccessKey"].get<std::string>(), j.value("Token", ""), expiration,
          "instance metadata (" + endpoint + ", role " + role + ")"};
}

}  // namespace zeroshard::ckpt::s3

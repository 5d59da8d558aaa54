// s3_credentials.cpp — the AWS default chain (s3_credentials.h).
#include "s3_credentials.h"

#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <pugixml.hpp>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>
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

// A fetch that failed in a way that may pass: no answer, a 5xx, throttling.
struct TransientError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
    : env_(std::move(env)),
      options_(options),
      settings_(settings_from(env_)),
      credentials_path_(home_file(env_, "AWS_SHARED_CREDENTIALS_FILE", "credentials")),
      config_path_(home_file(env_, "AWS_CONFIG_FILE", "config")),
      credentials_file_(read_aws_file(credentials_path_)),
      config_file_(read_aws_file(config_path_)),
      profile_(profile(settings_.profile)) {
  TORCH_CHECK(env_var(env_, "AWS_PROFILE").empty() || profile_.found, "S3 credentials: AWS_PROFILE=", settings_.profile,
              " names a profile that neither ", credentials_path_, " nor ", config_path_, " has; fix: add [",
              settings_.profile, "] to the credentials file or [profile ", settings_.profile,
              "] to the config file, or unset AWS_PROFILE");
}

CredentialChain::Profile CredentialChain::profile(const std::string& name) const {
  Profile p;
  auto c = config_file_.find(name == "default" ? "default" : "profile " + name);
  if (c != config_file_.end()) {
    p.keys = c->second;
    p.where = config_path_;
    p.found = true;
  }
  auto k = credentials_file_.find(name);
  if (k != credentials_file_.end()) {
    for (const auto& [key, value] : k->second) p.keys[key] = value;
    p.where = credentials_path_ + (p.where.empty() ? "" : " and " + p.where);
    p.found = true;
  }
  return p;
}

std::optional<std::string> CredentialChain::Profile::value(const std::string& key) const {
  auto it = keys.find(key);
  if (it == keys.end() || it->second.empty()) return std::nullopt;
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
    // Still valid: one try (the next request tries again). Expired: tried as a first fetch is.
    current_ = now < *current_->expiration ? fetch(source_) : fetch_retrying(source_);
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

std::string CredentialChain::source() {
  std::lock_guard<std::mutex> lock(mu_);
  return current_ ? current_->source : "";
}

void CredentialChain::expire(const std::string& access_key_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_ && current_->access_key_id == access_key_id) current_->expiration = Clock::now();
}

Credentials CredentialChain::resolve() {
  std::vector<Source> order{Source::kEnvironment, Source::kWebIdentity, Source::kProfileRole, Source::kProfile,
                            Source::kProfileWebIdentity, Source::kContainer, Source::kMetadata};
  // A profile that assumes its role with the environment's keys (credential_source = Environment)
  // asks for the role, not for those keys themselves: it comes before them.
  if (profile_.value("role_arn") && profile_.value("credential_source") == std::optional<std::string>("Environment")) {
    std::rotate(order.begin(), order.begin() + 2, order.begin() + 3);
  }
  std::string tried;
  for (Source s : order) {
    Credentials c = fetch_retrying(s);  // a configured source that fails throws: an error of its own
    if (!c.access_key_id.empty()) {
      source_ = s;
      return c;
    }
    tried += "\n  " + c.source;  // why this source had none
  }
  TORCH_CHECK(false, "S3 credentials: none found. Tried, in order:", tried,
              "\nFix: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, set AWS_PROFILE to a profile with keys, "
              "or run where a role is attached (EKS web identity or Pod Identity, an ECS task role, an EC2 instance "
              "profile)");
}

Credentials CredentialChain::fetch_retrying(Source source) {
  thread_local std::mt19937_64 random(std::random_device{}());
  const auto start = std::chrono::steady_clock::now();
  for (int attempt = 1;; ++attempt) {
    try {
      return fetch(source);
    } catch (const TransientError& e) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      TORCH_CHECK(attempt < options_.service_attempts, e.what(), " (", attempt, " attempt(s) in ",
                  static_cast<int>(elapsed * 10) / 10.0, " s; fix: check that the service is reachable from here)");
      const auto wait = options_.service_backoff * (1 << std::min(attempt - 1, 5));
      std::uniform_int_distribution<int64_t> jitter(wait.count() / 2, wait.count());
      std::this_thread::sleep_for(std::chrono::milliseconds(jitter(random)));
    }
  }
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
    case Source::kProfileRole: {
      if (!profile_.value("role_arn") || profile_.value("web_identity_token_file") ||
          !(profile_.value("source_profile") || profile_.value("credential_source"))) {
        none.source = "profile '" + settings_.profile + "': no role_arn with source_profile or credential_source";
        return none;
      }
      return assume_role(settings_.profile, 0);
    }
    case Source::kProfile: {
      auto id = profile_.value("aws_access_key_id"), secret = profile_.value("aws_secret_access_key");
      const std::string named = "S3 credentials: profile '" + settings_.profile + "' (" + profile_.where + ")";
      for (const char* unsupported : {"credential_process", "sso_start_url", "sso_session"}) {
        TORCH_CHECK(id || !profile_.value(unsupported), named, " gets its credentials through '", unsupported,
                    "', which zeroshard does not run; fix: export the credentials it gives as AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (e.g. `aws configure export-credentials "
                    "--format env`), or use a profile with keys");
      }
      TORCH_CHECK(!(profile_.value("source_profile") || profile_.value("credential_source")) ||
                      profile_.value("role_arn"),
                  named, " has ", profile_.value("source_profile") ? "source_profile" : "credential_source",
                  " but no role_arn to assume with it; fix: add role_arn, or remove it");
      TORCH_CHECK(!profile_.value("role_arn") || id || profile_.value("web_identity_token_file"), named,
                  " has role_arn but nothing to assume it with; fix: add source_profile, credential_source "
                  "(Environment, Ec2InstanceMetadata or EcsContainer) or web_identity_token_file");
      if (!id && !secret) {
        none.source = "profile '" + settings_.profile + "': " +
                      (profile_.where.empty() ? std::string("in no file under ~/.aws") : "no keys in " + profile_.where);
        return none;
      }
      TORCH_CHECK(id && secret, named, " has ",
                  id ? "aws_access_key_id but no aws_secret_access_key" : "aws_secret_access_key but no aws_access_key_id",
                  "; fix: give both");
      return {*id, *secret, profile_.value("aws_session_token").value_or(""), std::nullopt,
              "profile '" + settings_.profile + "' (" + profile_.where + ")"};
    }
    case Source::kProfileWebIdentity: {
      auto file = profile_.value("web_identity_token_file"), role = profile_.value("role_arn");
      if (!file || !role) {
        none.source = "profile '" + settings_.profile + "': no web_identity_token_file with role_arn";
        return none;
      }
      return web_identity(*file, *role, profile_.value("role_session_name").value_or(""),
                          "profile '" + settings_.profile + "' web_identity_token_file");
    }
    case Source::kContainer:
      return container();
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
  return sts("AssumeRoleWithWebIdentity",
             "RoleArn=" + http::uri_encode(role_arn, false) +
                 "&RoleSessionName=" + http::uri_encode(session.empty() ? "zeroshard" : session, false) +
                 "&WebIdentityToken=" + http::uri_encode(token, false),
             role_arn, where, nullptr);
}

Credentials CredentialChain::assume_role(const std::string& name, int depth) {
  const Profile p = profile(name);
  const std::string named = "S3 credentials: profile '" + name + "' (" + p.where + ")";
  const auto role = p.value("role_arn"), from = p.value("source_profile"), via = p.value("credential_source");
  TORCH_CHECK(!(from && via), named, " has both source_profile and credential_source; fix: keep one");
  TORCH_CHECK(!p.value("mfa_serial"), named, " assumes ", role.value_or("its role"),
              " with an MFA code (mfa_serial), which a training job cannot type; fix: export the session's "
              "credentials as AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN");
  TORCH_CHECK(depth < 8, named, ": source_profile chains more than 8 roles deep, or in a circle");
  Credentials signer;
  if (via) {
    const std::map<std::string, Source> sources{
        {"Environment", Source::kEnvironment}, {"Ec2InstanceMetadata", Source::kMetadata},
        {"EcsContainer", Source::kContainer}};
    auto s = sources.find(*via);
    TORCH_CHECK(s != sources.end(), named, ": credential_source '", *via,
                "' is not one of Environment, Ec2InstanceMetadata, EcsContainer");
    signer = s->second == Source::kMetadata ? instance_metadata() : fetch(s->second);
    TORCH_CHECK(!signer.access_key_id.empty(), named, ": credential_source ", *via, " has no credentials (",
                signer.source, ")");
  } else {
    const Profile source = profile(*from);
    const bool chained = *from != name && source.value("role_arn") &&
                         (source.value("source_profile") || source.value("credential_source"));
    if (chained) {
      signer = assume_role(*from, depth + 1);
    } else if (source.value("web_identity_token_file") && source.value("role_arn")) {
      signer = web_identity(*source.value("web_identity_token_file"), *source.value("role_arn"),
                            source.value("role_session_name").value_or(""),
                            "profile '" + *from + "' web_identity_token_file");
    } else {
      TORCH_CHECK(source.found, named, ": its source_profile '", *from, "' is in neither ", credentials_path_, " nor ",
                  config_path_, "; fix: add it, or name a profile that exists");
      TORCH_CHECK(source.value("aws_access_key_id") && source.value("aws_secret_access_key"), named,
                  ": its source_profile '", *from, "' (", source.where,
                  ") has no keys (aws_access_key_id and aws_secret_access_key); fix: give both");
      signer = {*source.value("aws_access_key_id"), *source.value("aws_secret_access_key"),
                source.value("aws_session_token").value_or(""), std::nullopt, "profile '" + *from + "'"};
    }
  }
  std::string form = "RoleArn=" + http::uri_encode(*role, false) + "&RoleSessionName=" +
                     http::uri_encode(p.value("role_session_name").value_or("zeroshard"), false);
  if (auto id = p.value("external_id")) form += "&ExternalId=" + http::uri_encode(*id, false);
  if (auto seconds = p.value("duration_seconds")) form += "&DurationSeconds=" + http::uri_encode(*seconds, false);
  return sts("AssumeRole", form, *role, "profile '" + name + "', with " + signer.source, &signer);
}

Credentials CredentialChain::sts(const std::string& action, const std::string& form, const std::string& role_arn,
                                 const std::string& where, const Credentials* signer) {
  http::Request r;
  r.method = "POST";
  r.url = settings_.sts_endpoint + "/";
  r.headers = {"Content-Type: application/x-www-form-urlencoded"};
  r.ca_bundle = settings_.ca_bundle;
  r.body = "Action=" + action + "&Version=2011-06-15&" + form;
  if (signer) {
    r.sigv4 = "aws:amz:" + settings_.region + ":sts";
    r.user_password = signer->access_key_id + ":" + signer->secret_access_key;
    if (!signer->session_token.empty()) r.headers.push_back("x-amz-security-token: " + signer->session_token);
  }
  auto resp = http::perform(r, options_.service_limits);
  const std::string asked = "S3 credentials: STS at " + settings_.sts_endpoint + ", " + action + " for role " +
                            role_arn + " (" + where + ")";
  if (resp.status == 0) throw TransientError(asked + ": no answer (" + resp.transport_error + ")");
  pugi::xml_document doc;
  doc.load_string(resp.body.c_str());
  const std::string code = xml_child_text(doc, "ErrorResponse/Error/Code");
  const std::string refused = asked + ": HTTP " + std::to_string(resp.status) + " " + code + ": " +
                              xml_child_text(doc, "ErrorResponse/Error/Message");
  if (resp.status >= 500 || resp.status == 429 || code == "Throttling" || code == "ThrottlingException" ||
      code == "RequestLimitExceeded" || code == "IDPCommunicationError") {
    throw TransientError(refused);
  }
  TORCH_CHECK(resp.status == 200, refused);
  auto creds = doc.first_element_by_path((action + "Response/" + action + "Result/Credentials").c_str());
  Credentials c{creds.child("AccessKeyId").text().as_string(), creds.child("SecretAccessKey").text().as_string(),
                creds.child("SessionToken").text().as_string(), parse_iso8601(creds.child("Expiration").text().as_string()),
                (signer ? "assumed role " : "web identity (" + where + ", role ") + role_arn +
                    (signer ? " (" + where + ", via STS)" : ", via STS)")};
  TORCH_CHECK(!c.access_key_id.empty() && !c.secret_access_key.empty() && c.expiration, "S3 credentials: STS's answer to ",
              action, " lacks AccessKeyId, SecretAccessKey or Expiration");
  return c;
}

namespace {

// Where the SDKs let AWS_CONTAINER_CREDENTIALS_FULL_URI point: anywhere over HTTPS; over
// HTTP only to this host or the ECS / EKS Pod Identity agents (the answer is a secret).
bool container_url_allowed(const std::string& url) {
  if (url.rfind("https://", 0) == 0) return true;
  if (url.rfind("http://", 0) != 0) return false;
  std::string host = url.substr(7, url.find_first_of("/?#", 7) - 7);
  host = host.substr(host.find('@') == std::string::npos ? 0 : host.find('@') + 1);
  if (host.rfind("[", 0) == 0) {
    host = host.substr(1, host.find(']') - 1);
  } else {
    host = host.substr(0, host.find(':'));
  }
  return host == "localhost" || host == "::1" || host == "169.254.170.2" || host == "169.254.170.23" ||
         host == "fd00:ec2::23" || host.rfind("127.", 0) == 0;
}

}  // namespace

Credentials CredentialChain::container() {
  const std::string relative = env_var(env_, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
  const std::string full = env_var(env_, "AWS_CONTAINER_CREDENTIALS_FULL_URI");
  Credentials none;
  if (relative.empty() && full.empty()) {
    none.source = "container: AWS_CONTAINER_CREDENTIALS_RELATIVE_URI and _FULL_URI are not set";
    return none;
  }
  const std::string var = relative.empty() ? "AWS_CONTAINER_CREDENTIALS_FULL_URI" : "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI";
  const std::string url = relative.empty() ? full : options_.container_endpoint + relative;
  TORCH_CHECK(!relative.empty() || container_url_allowed(full), "S3 credentials: ", var, "='", full,
              "' is plain HTTP to another host, which would send its credentials in the clear; fix: use https://, "
              "or this host's loopback or the ECS/EKS agent's address");
  std::string token = env_var(env_, "AWS_CONTAINER_AUTHORIZATION_TOKEN");
  const std::string token_file = env_var(env_, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    TORCH_CHECK(in, "S3 credentials: AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE '", token_file, "' cannot be read: ",
                std::strerror(errno), "; fix: mount the agent's token there or unset it");
    token.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    token = trim(token);
  }
  TORCH_CHECK(token.find_first_of("\r\n") == std::string::npos,
              "S3 credentials: the container authorization token (", token_file.empty() ? "AWS_CONTAINER_AUTHORIZATION_TOKEN" : token_file,
              ") has a line break inside it; fix: write the token alone");
  http::Request r;
  r.url = url;
  r.headers = {"Accept: application/json"};
  if (!token.empty()) r.headers.push_back("Authorization: " + token);
  r.ca_bundle = settings_.ca_bundle;
  r.no_proxy = true;  // its answers are secrets
  auto resp = http::perform(r, options_.service_limits);
  const std::string asked = "S3 credentials: the container credentials endpoint " + url + " (" + var + ")";
  if (resp.status == 0) throw TransientError(asked + " did not answer (" + resp.transport_error + ")");
  if (resp.status >= 500 || resp.status == 429) throw TransientError(asked + ": HTTP " + std::to_string(resp.status));
  auto j = nlohmann::json::parse(resp.body, nullptr, false);
  TORCH_CHECK(resp.status == 200, asked, " refused: HTTP ", resp.status, " ",
              j.is_object() ? j.value("message", j.value("Message", "")) : std::string(),
              token.empty() ? "; fix: give the agent's token (AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE)"
                            : "; fix: check the authorization token and the role's association");
  TORCH_CHECK(j.is_object() && j.contains("AccessKeyId") && j.contains("SecretAccessKey") && j.contains("Expiration"),
              asked, " answered without AccessKeyId, SecretAccessKey and Expiration");
  auto expiration = parse_iso8601(j["Expiration"].get<std::string>());
  TORCH_CHECK(expiration, asked, ": Expiration '", j["Expiration"].get<std::string>(), "' is not an ISO 8601 time");
  return {j["AccessKeyId"].get<std::string>(), j["SecretAccessKey"].get<std::string>(), j.value("Token", ""), expiration,
          "container credentials (" + var + ", " + url + (j.contains("RoleArn") ? ", role " + j.value("RoleArn", "") : "") +
              ")"};
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
  if (token.status == 0 && !token.connected) {
    none.source = "instance metadata: " + endpoint + " did not answer (" + token.transport_error + ")";
    return none;
  }
  const std::string asked = "S3 credentials: the instance metadata service at " + endpoint;
  auto passing = [&](const http::Response& r, const std::string& what) {  // may pass: try again
    if (r.status == 0 || r.status >= 500 || r.status == 429) {
      throw TransientError(asked + " " + what + ": " +
                           (r.status ? "HTTP " + std::to_string(r.status) : "no answer (" + r.transport_error + ")"));
    }
  };
  passing(token, "gave no IMDSv2 session token");
  TORCH_CHECK(token.status == 200, asked, " refused an IMDSv2 session token: HTTP ", token.status);
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
  passing(roles, "gave no role");
  TORCH_CHECK(roles.status == 200 && !trim(roles.body).empty(), asked, " gave no role: HTTP ", roles.status);
  std::string role = trim(roles.body.substr(0, roles.body.find('\n')));
  auto doc = fetch("/latest/meta-data/iam/security-credentials/" + role);
  passing(doc, "gave no credentials for role '" + role + "'");
  TORCH_CHECK(doc.status == 200, asked, " gave no credentials for role '", role, "': HTTP ", doc.status);
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

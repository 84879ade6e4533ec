"""Kestrel's grammar engine against xgrammar on a corpus of real-world JSON schemas: the AWS CloudFormation
resource schemas of the cfn-lint wheel (PyPI) of the version pinned in cfn_corpus.py, downloaded at test time with
`pip download --no-deps` and read from the zip (cfn_corpus.py; nothing of cfn-lint's is kept in this repository).
One schema per resource type (about 1,900, draft-07 style: `definitions`, `$ref` "#/definitions/...", `type`,
`enum`, `required`, `properties`, `additionalProperties`, `items`, `oneOf`/`anyOf`, `pattern`, `format`,
`minLength`/`maxLength`, `minimum`/`maximum`, `minItems`/`maxItems`, ...). Each is sent as a user would send it in
response_format: its JSON-Schema keywords, without CloudFormation's own top-level annotations of the resource
(typeName, handlers, primaryIdentifier, readOnlyProperties, createOnlyProperties, writeOnlyProperties, tagging,
propertyTransform, ...: cfn_corpus.CFN_TOP_LEVEL), which are no JSON Schema keywords; CloudFormation's keywords
inside property schemas (insertionOrder, relationshipRef, ...) stay, unknown to JSON Schema and ignored by both.

Every schema is compiled by Kestrel (on the tiny models' tokenizer, 4096 tokens, as in test_grammar_parity.py). One
Kestrel refuses is counted as skipped by the error's reason (xgrammar is not asked: compiling all of them with
xgrammar alone takes minutes on two cores); Kestrel must never crash. Of the others, a seeded sample of 300
(SAMPLE: the whole set takes about 3 minutes on two cores) is compiled by xgrammar (one it refuses is skipped,
counted) and walked with fixed seeds:
- two random walks over xgrammar's allowed tokens (never a token with a raw control character other than \\n \\r,
  which xgrammar allows inside strings with length bounds and Kestrel does not): one of 32 uniform steps, one of up to 400 steps that prefers a
  token closing something (a quote, a bracket, the stop token) so that most walks end; Kestrel replays each walk
  and its allowed-token set must be identical to xgrammar's at every step (up to the documented string-length
  difference of test_grammar_parity.deviation_ok); every walk that ends must validate with jsonschema (draft 7);
- at one random step of each walk, a token outside the mask (an invalid-by-construction continuation) must be
  refused by both.
A difference is a deliberate one (ON_PURPOSE, recognised from the schema as in test_grammar_parity_xgr_corpus.py)
or a pinned known gap (KNOWN_GAPS); one that disappears fails the test, so does any other difference.

With KESTREL_REQUIRE_XGRAMMAR=1 (tools/run-tests.sh) a missing xgrammar or a failed download is a failure, not a
skip. Set KESTREL_CFN_LINT_WHEEL to a downloaded cfn_lint-VERSION-py3-none-any.whl to skip the download."""

import json
import random
import re
import time
from collections import Counter

import jsonschema
import pytest

import cfn_corpus as cc
import grammar_parity as gp
import test_server_harness as h
from test_grammar_parity import as_anyof, deviation_ok, show
from test_grammar_parity_xgr_corpus import (PATTERN_LENGTH, SELF_INCONSISTENT, Engines, _fail_or_skip,
                                           has_pattern_with_length, self_check, walk_text)
from test_server_harness import tiny_dir  # noqa: F401 (fixture)

EOS = h.EOS
UNIFORM_STEPS, CLOSING_STEPS = 32, 400
SAMPLE, SAMPLE_SEED = 300, 1898  # the schemas walked: 300 of those Kestrel compiles, a seeded sample (the time)

DATE_TIME_T = ("format date-time: Kestrel's RFC 3339 regex takes a lowercase 't' between date and time, "
               "xgrammar's only 'T' (docs/structured-output.md: formats are Kestrel's RFC regexes)")
OBJECT_ANY = ("an object schema with no object keywords is any object: xgrammar reads "
              "{\"type\": [\"object\", \"string\"], \"format\": \"json\"} (cfn-lint's JSON-valued properties) as the "
              "empty object or a string (docs/structured-output.md)")
XGR_MASK = ("xgrammar's mask leaves out a token its own matcher accepts, Kestrel's mask has it (the masks differ "
            "nowhere else)")


def documented_difference(why, spec):
    """The documented reason for a difference, recognised from where it is, or None."""
    if re.search(r"""\{': only Kestrel allows \[b'"'\], only xgrammar \[\]$""", why) and \
            re.search(r'"format": "json", "type": \["object", "string"\]', json.dumps(spec)):
        return OBJECT_ANY
    if re.search(r"""after b'.*"\d{4}-\d\d-\d\d': only Kestrel allows \[b't'\], only xgrammar \[\]""", why):
        return DATE_TIME_T
    if SELF_INCONSISTENT in why:
        return XGR_MASK
    if (re.search(r"Kestrel refuses the walk: \{'error': 'token \d+ refused after", why) or
            re.search(r"only Kestrel allows \[\], only xgrammar \[", why)) and has_pattern_with_length(spec):
        return PATTERN_LENGTH
    return None


# Schemas whose masks differ on purpose (docs/structured-output.md), each recognised by documented_difference():
# resource type -> that reason.
ON_PURPOSE = {
    "AWS::ARCZonalShift::AutoshiftObserverNotificationStatus": PATTERN_LENGTH,
    "AWS::ApiGatewayV2::Model": OBJECT_ANY,
    "AWS::ApiGatewayV2::Route": OBJECT_ANY,
    "AWS::Bedrock::KnowledgeBasePolicy": PATTERN_LENGTH,
    "AWS::BedrockAgentCore::ConsentPortal": PATTERN_LENGTH,
    "AWS::Chatbot::SlackChannelConfiguration": PATTERN_LENGTH,
    "AWS::Chime::AppInstance": DATE_TIME_T,
    "AWS::CloudFormation::GeneratedTemplate": DATE_TIME_T,
    "AWS::CloudFront::ConnectionGroup": DATE_TIME_T,
    "AWS::ComputeOptimizer::AutomationRule": DATE_TIME_T,
    "AWS::Connect::DataLakeAssociation": PATTERN_LENGTH,
    "AWS::ControlTower::EnabledControl": PATTERN_LENGTH,
    "AWS::DAX::ParameterGroup": OBJECT_ANY,
    "AWS::DRS::SourceNetwork": PATTERN_LENGTH,
    "AWS::DataBrew::Ruleset": PATTERN_LENGTH,
    "AWS::DataExchange::DataSet": DATE_TIME_T,
    "AWS::DataZone::DomainUnit": DATE_TIME_T,
    "AWS::Deadline::Budget": DATE_TIME_T,
    "AWS::Deadline::Worker": DATE_TIME_T,
    "AWS::EC2::TransitGatewayPeeringAttachment": DATE_TIME_T,
    "AWS::Events::Archive": OBJECT_ANY,
    "AWS::FIS::TargetAccountConfiguration": PATTERN_LENGTH,
    "AWS::Glue::DevEndpoint": OBJECT_ANY,
    "AWS::IoT::ResourceSpecificLogging": PATTERN_LENGTH,
    "AWS::LakeFormation::Tag": PATTERN_LENGTH,
    "AWS::Lex::BotVersion": PATTERN_LENGTH,
    "AWS::Lightsail::KeyPair": DATE_TIME_T,
    "AWS::MediaConvert::JobTemplate": OBJECT_ANY,
    "AWS::NetworkFlowMonitor::Monitor": PATTERN_LENGTH,
    "AWS::Notifications::NotificationHub": DATE_TIME_T,
    "AWS::Pinpoint::PushTemplate": OBJECT_ANY,
    "AWS::PricingPlanManager::Subscription": DATE_TIME_T,
    "AWS::QuickSight::ApprovalPolicy": DATE_TIME_T,
    "AWS::RAM::PermissionAssociation": DATE_TIME_T,
    "AWS::RAM::PrincipalAssociation": DATE_TIME_T,
    "AWS::RAM::ResourceAssociation": DATE_TIME_T,
    "AWS::RDS::DBClusterParameterGroup": OBJECT_ANY,
    "AWS::ResilienceHubV2::ServiceFunction": DATE_TIME_T,
    "AWS::RolesAnywhere::TrustAnchor": PATTERN_LENGTH,
    "AWS::SMSVOICE::NotifyConfiguration": PATTERN_LENGTH,
    "AWS::SSO::Instance": PATTERN_LENGTH,
    "AWS::SecurityAgent::TargetDomain": DATE_TIME_T,
    "AWS::ServiceCatalog::LaunchNotificationConstraint": PATTERN_LENGTH,
    "AWS::ServiceCatalog::LaunchTemplateConstraint": PATTERN_LENGTH,
    "AWS::ServiceCatalog::PortfolioShare": PATTERN_LENGTH,
    "AWS::ServiceCatalog::ResourceUpdateConstraint": PATTERN_LENGTH,
    "AWS::ServiceCatalog::ServiceAction": PATTERN_LENGTH,
    "AWS::ServiceCatalog::StackSetConstraint": PATTERN_LENGTH,
}
# Schemas whose masks differ for a reason Kestrel does not fix (yet): resource type -> reason. Each must still differ.
KNOWN_GAPS = {}


@pytest.fixture(scope="module")
def corpus():
    try:
        resources = cc.fetch_schemas()
    except Exception as e:  # noqa: BLE001 (a download failure of any kind)
        _fail_or_skip(f"cfn-lint {cc.CFN_LINT_VERSION}'s wheel could not be had: {e}")
    return {t: cc.as_response_format(s) for t, s in resources.items()}


@pytest.fixture(scope="module")
def engines(tiny_dir):  # noqa: F811
    e = Engines(tiny_dir)
    yield e
    e.probe.close()


class Walker:
    """Random walks over xgrammar's allowed tokens, with the mask before each token and after the last."""

    def __init__(self, e):
        self.e, self.np = e, e.ref.np
        self.V = e.ref.V
        self.closing = self.np.zeros(self.V, dtype=bool)
        for t, b in enumerate(e.ref.tokens):
            self.closing[t] = any(c in b for c in b'"]}')
        self.closing[EOS] = True
        # Never a token with a raw control character other than \n \r: inside a string with length bounds xgrammar
        # allows them and Kestrel does not (the documented difference); nowhere else does either engine allow them.
        self.walkable = self.np.array([not any(c < 0x20 and c not in b"\n\r" for c in b) for b in e.ref.tokens])

    def walk(self, compiled, rng, steps, prefer_closing):
        np = self.np
        m = self.e.xgr.GrammarMatcher(compiled)
        buf = np.zeros((1, (self.V + 31) // 32), dtype=np.int32)
        tokens, masks = [], []
        for i in range(steps + 1):
            if m.is_terminated():
                masks.append(0)
                break
            buf[:] = 0
            m.fill_next_token_bitmask(buf)
            masks.append(int.from_bytes(buf.tobytes(), "little") & ((1 << self.V) - 1))
            if i == steps:
                break
            allowed = np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[:self.V])
            pool = allowed = allowed[self.walkable[allowed]]
            if prefer_closing:
                closing = allowed[self.closing[allowed]]
                if EOS in allowed and rng.random() < 0.9:
                    pool = np.array([EOS])
                elif len(closing) and rng.random() < 0.6:
                    pool = closing
            assert len(pool), "xgrammar allows no walkable token and has not ended"
            t = int(pool[rng.randrange(len(pool))])
            assert m.accept_token(t)
            tokens.append(t)
        return tokens, masks, m.is_terminated()


def check_walk(e, spec, compiled, tokens, xmasks, terminated, rng, stats):
    """None when Kestrel agrees with xgrammar on the walk, else what differs."""
    k = e.ask({"cmd": "walk", "kind": "json_schema", "spec": spec, "tokens": tokens})
    if "crash" in k or "error" in k:
        return f"Kestrel refuses the walk: {k}"
    k["xmasks"] = xmasks
    text = json.dumps(spec)
    for i, (mine, theirs) in enumerate(zip(k["masks"], xmasks)):
        a = gp.mask_int(mine)
        if a != theirs and not deviation_ok(e.ref, a, theirs, text):
            k["tokens"] = tokens
            return f"masks differ at step {i}: {show(e.ref, k, i)}" + self_check(e, compiled, k, i)
    if len(k["masks"]) != len(xmasks) or k["terminated"] != terminated:
        return f"Kestrel's walk has {len(k['masks'])} masks (ended {k['terminated']}), xgrammar's {len(xmasks)} " \
               f"(ended {terminated})"
    stats["walk_steps"] += len(tokens)
    if terminated:
        stats["ended"] += 1
        out = walk_text(e.ref, k)
        try:
            jsonschema.Draft7Validator(as_anyof(spec)).validate(json.loads(out))
        except jsonschema.ValidationError as x:
            return f"the output {out!r} breaks the schema: {x.message}"
        stats["validated"] += 1
    # An invalid-by-construction continuation: a token outside the mask at a random step, refused by both.
    step = rng.randrange(len(tokens) + (0 if terminated else 1))
    both = xmasks[step] | gp.mask_int(k["masks"][step])  # they differ where deviation_ok lets them
    outside = [t for t in range(e.ref.V) if not both >> t & 1 and e.ref.tokens[t]]
    t = rng.choice(outside)
    bad = tokens[:step] + [t]
    k2 = e.ask({"cmd": "walk", "kind": "json_schema", "spec": spec, "tokens": bad})
    m = e.xgr.GrammarMatcher(compiled)
    assert all(m.accept_token(x) for x in tokens[:step])
    if "refused" not in k2.get("error", "") or m.accept_token(t):
        return f"token {t} outside the mask at step {step}: Kestrel {k2.get('error')}, xgrammar accepts it"
    stats["invalid_refused"] += 1
    return None


def refusal_reason(msg):
    """A Kestrel compile error without where it is (the keywords named, a regex and numbers left out)."""
    msg = re.sub(r"^JSON schema at '[^']*': ", "", msg)
    msg = re.sub(r"regex '.*', at character \d+: ", "regex: ", msg)
    return re.sub(r"\d+", "N", msg)[:110]


def kestrel_compiles(e, spec, stats):
    """Whether Kestrel compiles the schema (counting the reason when it refuses); raises on a crash."""
    k = e.ask({"cmd": "walk", "kind": "json_schema", "spec": spec, "tokens": []})
    assert "crash" not in k, f"Kestrel crashed compiling {json.dumps(spec)[:300]}: {k['crash']}"
    if "error" in k:
        stats["skipped"]["Kestrel refuses: " + refusal_reason(k["error"])] += 1
        return False
    return True


def run_schema(e, walker, name, spec, stats):
    try:
        compiled = e.ref.compile("json_schema", spec)
    except Exception as x:  # noqa: BLE001 (xgrammar raises RuntimeError, ValueError, ...)
        stats["skipped"]["xgrammar refuses it (Kestrel compiles it): " + str(x)[:80]] += 1
        return None
    stats["run"] += 1
    rng = random.Random(name)
    for w, (steps, closing) in enumerate(((UNIFORM_STEPS, False), (CLOSING_STEPS, True))):
        tokens, xmasks, terminated = walker.walk(compiled, rng, steps, closing)
        why = check_walk(e, spec, compiled, tokens, xmasks, terminated, rng, stats)
        if why is not None:
            return f"walk {w}: {why}"
        stats["walks"] += 1
    return None


def test_cloudformation_schemas(corpus, engines):
    t0 = time.monotonic()
    walker = Walker(engines)
    stats = {"run": 0, "skipped": Counter(), "walks": 0, "walk_steps": 0, "ended": 0, "validated": 0,
             "invalid_refused": 0}
    compiled = [name for name in sorted(corpus) if kestrel_compiles(engines, corpus[name], stats)]
    sample = sorted(random.Random(SAMPLE_SEED).sample(compiled, min(SAMPLE, len(compiled))))
    differ, documented = {}, {}
    for name in sample:
        why = run_schema(engines, walker, name, corpus[name], stats)
        if why is None:
            continue
        differ[name] = f"{json.dumps(corpus[name])[:300]}: {why}"
        doc = documented_difference(why, corpus[name])
        if doc is not None:
            documented[name] = doc
    elapsed = time.monotonic() - t0

    skipped = sum(stats["skipped"].values())
    lines = [f"cfn-lint {cc.CFN_LINT_VERSION} CloudFormation resource schemas: found {len(corpus)}, compiled by "
             f"Kestrel {len(compiled)} (walked: {len(sample)} of them, a seeded sample), run by both {stats['run']}, "
             f"skipped {skipped}"]
    for why, n in stats["skipped"].most_common():
        lines.append(f"    skipped: {n} x {why}")
    for name, why in sorted(documented.items()):
        lines.append(f"    differs on purpose: {name}: {why}")
    for name in sorted(set(differ) & set(KNOWN_GAPS)):
        lines.append(f"    known gap: {name}: {KNOWN_GAPS[name][:60]}...")
    lines.append(f"  walks {stats['walks']} ({stats['walk_steps']} steps compared), ended and validated by "
                 f"jsonschema {stats['validated']} of {stats['ended']}, invalid tokens refused by both "
                 f"{stats['invalid_refused']}; time {elapsed:.1f} s")
    print("\n".join(lines))

    unexplained = {n: w for n, w in differ.items()
                   if n not in KNOWN_GAPS and not (n in ON_PURPOSE and documented.get(n) == ON_PURPOSE[n])}
    for n in set(differ) & {n for n, why in KNOWN_GAPS.items() if why == XGR_MASK}:
        assert documented.get(n) == XGR_MASK, differ[n]
    vanished = sorted(((set(KNOWN_GAPS) | set(ON_PURPOSE)) & set(sample)) - set(differ))
    assert not unexplained, "masks differ from xgrammar's:\n" + "\n".join(f"{n}: {w}" for n, w in unexplained.items())
    assert not vanished, f"known gaps or deliberate differences that no longer differ: {vanished}"
    # The corpus must still be there in size, and hundreds of its schemas must run on both engines.
    assert len(corpus) >= 1500, len(corpus)
    assert len(compiled) >= 400 and len(sample) == SAMPLE and stats["run"] >= SAMPLE - 10, (len(compiled), stats)
    # Every walk of a schema that does not differ is compared in full (one that differs stops at the difference).
    assert 2 * (stats["run"] - len(differ)) <= stats["walks"] <= 2 * stats["run"], stats
    assert stats["invalid_refused"] == stats["walks"], stats
    assert stats["validated"] == stats["ended"] >= stats["run"] // 2, stats

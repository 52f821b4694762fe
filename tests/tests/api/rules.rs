//! Issue 14 item 16: the rules the OpenAPI document states about requests are exactly the
//! rules the service enforces. For every rule, values just inside are valid for the served
//! document and accepted by the Router, values just outside are invalid for the document and
//! refused (400 INVALID_ARGUMENT, or 404 where a malformed id is NOT_FOUND like any unknown
//! one). And every rule the document states about a request — a bound, a length, a pattern,
//! an enum, a required field, uniqueItems, a oneOf or anyOf — at every place of every
//! operation's body, query, path or header, is hit by at least one of those refusals: a rule
//! cannot be added to the document, or to another place of it, without a case here.
//!
//! Wrong JSON types and unknown fields (`type`, `additionalProperties`) are serde's and are
//! covered by `bad_input`. Rules the document cannot state (one field against another, or
//! against the database) are in its descriptions and in the tests of each area.

use std::collections::{BTreeMap, BTreeSet};

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request};
use jsonschema::error::ValidationErrorKind;
use poolmgr_core::domain::Phase;
use poolmgr_core::rules::{
    MAX_BASIC_AUTH_TOKEN_CHARS, MAX_COMMAND_CHARS, MAX_COMMANDS, MAX_CORDON_REASON_CHARS, MAX_EVENTS_LIMIT,
    MAX_EVENTS_WAIT_SECONDS, MAX_HOST_ADDRESS_CHARS, MAX_LEASE_ID_CHARS, MAX_PAGE_KEY_CHARS, MAX_PAGE_SIZE,
    MAX_PAGE_TOKEN_CHARS, MAX_PEM_CHARS, MAX_POOL_SIZE, MAX_REQUEST_ID_BYTES, MEMORY_IN_MB, VCPU,
};
use poolmgr_tests::*;
use serde_json::{Value, json};

/// The operations that take input, with a request every rule's values are set into.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Claim,
    PostPool,
    PutPool,
    GetPool,
    DeletePool,
    ListPools,
    PostHost,
    PutHost,
    GetHost,
    DeleteHost,
    Cordon,
    Uncordon,
    GetLease,
    Heartbeat,
    Release,
    ListLeases,
    ListVms,
    Events,
}

use Op::*;

const POOL_BODY: &[Op] = &[PostPool, PutPool];
const HOST_BODY: &[Op] = &[PostHost, PutHost];

/// A lease every lease route can reach: the longest id a lease can have.
fn long_lease() -> String {
    "a".repeat(MAX_LEASE_ID_CHARS)
}

const ALL: &[Op] = &[
    Claim, PostPool, PutPool, GetPool, DeletePool, ListPools, PostHost, PutHost, GetHost, DeleteHost, Cordon, Uncordon,
    GetLease, Heartbeat, Release, ListLeases, ListVms, Events,
];

impl Op {
    /// Method, documented path, token, and the statuses that mean "the input passed
    /// validation".
    fn spec(self) -> (Method, &'static str, &'static str, &'static [u16]) {
        match self {
            // Pool ci has no AVAILABLE VM: a valid claim answers 429, or 404 for another pool.
            Claim => (Method::POST, "/v1/claims", CLIENT_A, &[429, 404]),
            PostPool => (Method::POST, "/v1/pools", ADMIN, &[201]),
            PutPool => (Method::PUT, "/v1/pools/{namespace}/{name}", ADMIN, &[200, 404]),
            GetPool => (Method::GET, "/v1/pools/{namespace}/{name}", ADMIN, &[200, 404]),
            DeletePool => (Method::DELETE, "/v1/pools/{namespace}/{name}", ADMIN, &[404]),
            ListPools => (Method::GET, "/v1/pools", ADMIN, &[200]),
            PostHost => (Method::POST, "/v1/hosts", ADMIN, &[201]),
            PutHost => (Method::PUT, "/v1/hosts/{name}", ADMIN, &[200]),
            GetHost => (Method::GET, "/v1/hosts/{name}", ADMIN, &[200]),
            DeleteHost => (Method::DELETE, "/v1/hosts/{name}", ADMIN, &[204]),
            Cordon => (Method::POST, "/v1/hosts/{name}/cordon", ADMIN, &[200]),
            Uncordon => (Method::POST, "/v1/hosts/{name}/uncordon", ADMIN, &[200]),
            GetLease => (Method::GET, "/v1/leases/{lease_id}", CLIENT_A, &[200]),
            Heartbeat => (Method::POST, "/v1/leases/{lease_id}/heartbeat", CLIENT_A, &[200]),
            Release => (Method::DELETE, "/v1/leases/{lease_id}", CLIENT_A, &[204]),
            ListLeases => (Method::GET, "/v1/leases", ADMIN, &[200]),
            ListVms => (Method::GET, "/v1/vms", ADMIN, &[200]),
            Events => (Method::GET, "/v1/events", ADMIN, &[200]),
        }
    }

    /// The status of a refusal of a value at `at`: 400, but a malformed lease id is
    /// NOT_FOUND like any unknown one, and so is a host name in a path except on PUT.
    fn refused(self, at: At) -> u16 {
        match (self, at) {
            (
                GetHost | DeleteHost | Cordon | Uncordon | GetLease | Heartbeat | Release,
                At::Path(_) | At::PathAndBody(_),
            ) => 404,
            _ => 400,
        }
    }

    fn base(self) -> Req {
        let path = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut r = Req { op: self, path: BTreeMap::new(), query: BTreeMap::new(), header: None, body: None };
        match self {
            Claim => r.body = Some(json!({"pool": {"namespace": "default", "name": "ci"}})),
            PostPool => r.body = Some(pool_spec("web", 1)),
            PutPool => {
                r.path = path(&[("namespace", "default"), ("name", "ci")]);
                r.body = Some(pool_spec("ci", 1));
            }
            GetPool | DeletePool => r.path = path(&[("namespace", "default"), ("name", "nope")]),
            PostHost => r.body = Some(json!({"name": "fresh", "address": "127.0.0.2:9", "tls": {"insecure": true}})),
            PutHost => {
                r.path = path(&[("name", "spare")]);
                r.body = Some(json!({"address": "127.0.0.1:9"}));
            }
            GetHost | Uncordon => r.path = path(&[("name", "spare")]),
            Cordon => {
                r.path = path(&[("name", "spare")]);
                r.body = Some(json!({"reason": "maintenance"}));
            }
            DeleteHost => r.path = path(&[("name", "gone")]),
            GetLease | Heartbeat | Release => r.path = path(&[("lease_id", &long_lease())]),
            ListPools | ListLeases | ListVms | Events => {}
        }
        r
    }

    /// Makes what an accepted request of this operation needs (what a previous one ended).
    async fn prepare(self, app: &TestApp) {
        match self {
            GetLease | Heartbeat | Release => {
                let n = format!("SELECT count(*) FROM leases WHERE lease_id = '{}'", long_lease());
                if app.scalar_i64(&n).await == 0 {
                    seed_long_lease(app).await;
                }
            }
            DeleteHost => drop(
                app.post(
                    ADMIN,
                    "/v1/hosts",
                    json!({"name": "gone", "address": "127.0.0.3:9", "tls": {"insecure": true}}),
                )
                .await,
            ),
            _ => {}
        }
    }

    /// Undoes what an accepted request created, so the next one can create it again.
    async fn undo(self, app: &TestApp, req: &Req) {
        let body = req.body.as_ref();
        let field = |k: &str| body.and_then(|b| b[k].as_str()).unwrap_or("default").to_owned();
        match self {
            PostPool => {
                app.delete(ADMIN, &format!("/v1/pools/{}/{}", field("namespace"), field("name"))).await.assert_ok(204)
            }
            PostHost => app.delete(ADMIN, &format!("/v1/hosts/{}", field("name"))).await.assert_ok(204),
            _ => &Value::Null,
        };
    }
}

/// One request, before it is sent.
#[derive(Clone, Debug)]
struct Req {
    op: Op,
    path: BTreeMap<String, String>,
    query: BTreeMap<String, Value>,
    header: Option<String>,
    body: Option<Value>,
}

/// Where a case puts its values.
#[derive(Clone, Copy, Debug)]
enum At {
    /// A JSON pointer into the body (its parent must exist), or "" for the whole body.
    Body(&'static str),
    Query(&'static str),
    Path(&'static str),
    /// A path parameter and the body field of that name (a PUT's must match).
    PathAndBody(&'static str),
    /// The `Idempotency-Key` header.
    Header,
}

/// A value that removes the field or parameter instead of setting it.
fn absent() -> Value {
    json!({"(absent)": true})
}

impl Req {
    fn set(&mut self, at: At, v: Value) {
        let gone = v == absent();
        match at {
            At::Body("") => self.body = Some(v),
            At::Body(ptr) => {
                let (parent, key) = ptr.rsplit_once('/').unwrap();
                let body = self.body.as_mut().expect("a body");
                let parent = if parent.is_empty() { body } else { body.pointer_mut(parent).expect(ptr) };
                match parent {
                    Value::Object(o) if gone => drop(o.remove(key)),
                    Value::Object(o) => drop(o.insert(key.into(), v)),
                    Value::Array(a) => a[key.parse::<usize>().unwrap()] = v,
                    other => panic!("{ptr}: parent is {other}"),
                }
            }
            At::Query(k) if gone => drop(self.query.remove(k)),
            At::Query(k) => drop(self.query.insert(k.into(), v)),
            At::Path(k) => drop(self.path.insert(k.into(), v.as_str().expect("a path value is a string").into())),
            At::PathAndBody(k) => {
                self.set(At::Path(k), v.clone());
                self.body.as_mut().expect("a body")[k] = v;
            }
            At::Header => self.header = (!gone).then(|| v.as_str().expect("a header is a string").into()),
        }
    }

    fn uri(&self) -> String {
        let (_, template, ..) = self.op.spec();
        let mut uri = template.to_string();
        for (k, v) in &self.path {
            uri = uri.replace(&format!("{{{k}}}"), &encode(v));
        }
        let query: Vec<String> = self
            .query
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(&v.as_str().map_or_else(|| v.to_string(), String::from))))
            .collect();
        if !query.is_empty() {
            uri = format!("{uri}?{}", query.join("&"));
        }
        uri
    }

    async fn send(&self, app: &TestApp) -> TestResponse {
        let (method, _, token, ..) = self.op.spec();
        let mut b =
            Request::builder().method(method).uri(self.uri()).header("authorization", format!("Bearer {token}"));
        if let Some(h) = &self.header {
            b = b.header("idempotency-key", HeaderValue::from_bytes(h.as_bytes()).expect("header bytes"));
        }
        let req = match &self.body {
            Some(v) => b.header("content-type", "application/json").body(Body::from(v.to_string())),
            None => b.body(Body::empty()),
        };
        app.send(req.unwrap()).await
    }
}

/// Percent-encodes all but the unreserved characters.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The served document and what it says about requests.
struct Doc(Value);

impl Doc {
    fn operation(&self, op: Op) -> &Value {
        let (method, path, ..) = op.spec();
        &self.0["paths"][path][method.as_str().to_lowercase()]
    }

    /// The schema of each input of `op`, named as its rule sites are: `"PUT /v1/hosts/{name} body"`.
    fn inputs(&self, op: Op) -> Vec<(String, &Value)> {
        let (method, path, ..) = op.spec();
        let o = self.operation(op);
        let mut out = vec![];
        if let Some(s) = o.pointer("/requestBody/content/application~1json/schema") {
            out.push((format!("{method} {path} body"), s));
        }
        for p in o["parameters"].as_array().into_iter().flatten() {
            out.push((
                format!("{method} {path} {}.{}", p["in"].as_str().unwrap(), p["name"].as_str().unwrap()),
                &p["schema"],
            ));
        }
        out
    }

    /// Every rule site of `op`: `"{input}{instance path} @ {schema location}"`, array items
    /// and map values written `*`.
    fn sites(&self, op: Op, out: &mut BTreeSet<String>) {
        for (input, schema) in self.inputs(op) {
            self.walk(schema, &input, "", "", out);
        }
    }

    fn walk(&self, s: &Value, input: &str, at: &str, loc: &str, out: &mut BTreeSet<String>) {
        if let Some(r) = s["$ref"].as_str() {
            let name = r.rsplit('/').next().unwrap();
            let target = &self.0["components"]["schemas"][name];
            return self.walk(target, input, at, &format!("/components/schemas/{name}"), out);
        }
        let mut site = |at: &str, kw: &str| out.insert(format!("{input}{at} @ {loc}/{kw}"));
        for kw in [
            "minimum",
            "maximum",
            "minLength",
            "maxLength",
            "pattern",
            "enum",
            "minItems",
            "maxItems",
            "oneOf",
            "anyOf",
        ] {
            if s.get(kw).is_some() {
                site(at, kw);
            }
        }
        if s["uniqueItems"] == json!(true) {
            site(at, "uniqueItems");
        }
        if s["type"] == json!("null") {
            site(at, "type");
        }
        for f in s["required"].as_array().into_iter().flatten() {
            site(&format!("{at}/{}", f.as_str().unwrap()), "required");
        }
        for (k, sub) in s["properties"].as_object().into_iter().flatten() {
            self.walk(sub, input, &format!("{at}/{k}"), &format!("{loc}/properties/{k}"), out);
        }
        for (kw, star) in [("items", true), ("additionalProperties", true)] {
            if s[kw].is_object() {
                self.walk(&s[kw], input, &format!("{at}/{}", if star { "*" } else { "" }), &format!("{loc}/{kw}"), out);
            }
        }
        for kw in ["allOf", "oneOf", "anyOf"] {
            for (i, sub) in s[kw].as_array().into_iter().flatten().enumerate() {
                self.walk(sub, input, at, &format!("{loc}/{kw}/{i}"), out);
            }
        }
    }

    /// Whether `req` is valid for the document, and the rule sites its errors name (those
    /// under a oneOf or anyOf included).
    fn check(&self, req: &Req) -> (bool, BTreeSet<String>) {
        let mut sites = BTreeSet::new();
        let mut valid = true;
        for (input, schema) in self.inputs(req.op) {
            let (_, name) = input.rsplit_once(' ').unwrap();
            let instance = match name.split_once('.') {
                None => match &req.body {
                    Some(b) => b.clone(),
                    None => continue,
                },
                Some(("query", k)) => match req.query.get(k) {
                    Some(v) => v.clone(),
                    None => continue,
                },
                Some(("path", k)) => json!(req.path[k]),
                Some(("header", _)) => match &req.header {
                    Some(h) => json!(h),
                    None => continue,
                },
                Some(other) => panic!("input {other:?}"),
            };
            let mut root = schema.clone();
            root["components"] = self.0["components"].clone();
            let validator = jsonschema::draft202012::options().build(&root).expect("the document's schemas compile");
            for e in validator.iter_errors(&instance) {
                valid = false;
                collect(&input, &e, &mut sites);
            }
        }
        (valid, sites)
    }
}

fn collect(input: &str, e: &jsonschema::ValidationError, out: &mut BTreeSet<String>) {
    let at: Vec<String> = e
        .instance_path()
        .as_str()
        .split('/')
        .skip(1)
        .map(|seg| if seg.parse::<usize>().is_ok() { "*".into() } else { seg.to_owned() })
        .collect();
    let mut at = if at.is_empty() { String::new() } else { format!("/{}", at.join("/")) };
    let loc = e.schema_path().as_str().to_owned();
    let loc = if loc.starts_with("/components/") { loc } else { loc.trim_start_matches('#').to_owned() };
    match e.kind() {
        ValidationErrorKind::Required { property } => at = format!("{at}/{}", property.as_str().unwrap()),
        ValidationErrorKind::OneOfNotValid { context }
        | ValidationErrorKind::OneOfMultipleValid { context }
        | ValidationErrorKind::AnyOf { context } => {
            for sub in context.iter().flatten() {
                collect(input, sub, out);
            }
        }
        _ => {}
    }
    out.insert(format!("{input}{at} @ {loc}"));
}

/// A change to a base request: a place and the value to put there.
type Given = (At, fn() -> Value);

/// One rule: where its values go, on which operations, and values just inside and just
/// outside it.
struct Case {
    what: &'static str,
    ops: &'static [Op],
    at: At,
    /// Changes to the base request that the values need (a strategy for `min_size`, …).
    given: &'static [Given],
    inside: Vec<Value>,
    outside: Vec<Value>,
}

fn case(what: &'static str, ops: &'static [Op], at: At, inside: Vec<Value>, outside: Vec<Value>) -> Case {
    Case { what, ops, at, given: &[], inside, outside }
}

fn s(n: usize, c: char) -> Value {
    json!(c.to_string().repeat(n))
}

fn pem() -> Value {
    json!("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
}

fn volume(source: Value) -> Value {
    json!({"id": "data", "source": source})
}

fn cases() -> Vec<Case> {
    assert_eq!(base64url(&"a".repeat(MAX_PAGE_KEY_CHARS)).len(), MAX_PAGE_TOKEN_CHARS, "the longest page token");
    let name63 = s(63, 'a');
    let name_rule = |what, ops, at| {
        let mut outside = vec![json!("A"), json!("-a"), json!("a_b"), s(64, 'a')];
        if let At::Body(_) = at {
            outside.push(json!(""));
        }
        case(what, ops, at, vec![json!("a"), json!("a-0"), name63.clone()], outside)
    };
    let filter_rule = |what, ops, at| {
        case(what, ops, at, vec![json!(""), json!("a"), name63.clone()], vec![json!("A"), json!("a_b"), s(64, 'a')])
    };
    let b = At::Body;
    vec![
        // Claims.
        name_rule("a PoolRef namespace", &[Claim], b("/pool/namespace")),
        name_rule("a PoolRef name", &[Claim], b("/pool/name")),
        case("a claim names its pool", &[Claim], b("/pool"), vec![], vec![absent()]),
        case("PoolRef has both parts", &[Claim], b("/pool/name"), vec![], vec![absent()]),
        case("PoolRef has both parts", &[Claim], b("/pool/namespace"), vec![], vec![absent()]),
        case(
            "request_id is at most 255 bytes",
            &[Claim],
            b("/request_id"),
            vec![json!(null), json!(""), s(MAX_REQUEST_ID_BYTES, 'r')],
            vec![s(MAX_REQUEST_ID_BYTES + 1, 'r')],
        ),
        case(
            "Idempotency-Key is at most 255 visible ASCII characters",
            &[Claim],
            At::Header,
            vec![json!("k-1"), json!("a b\t~"), s(MAX_REQUEST_ID_BYTES, 'k')],
            vec![s(MAX_REQUEST_ID_BYTES + 1, 'k'), json!("é")],
        ),
        // PoolSpec, through POST and PUT.
        name_rule("a pool's name", &[PostPool], b("/name")),
        name_rule("a pool's namespace", &[PostPool], b("/namespace")),
        name_rule("a pool's name, in the path and the body", &[PutPool], At::PathAndBody("name")),
        name_rule("a pool's namespace, in the path and the body", &[PutPool], At::PathAndBody("namespace")),
        case("a pool needs a name", POOL_BODY, b("/name"), vec![], vec![absent()]),
        case("a pool needs a size", POOL_BODY, b("/size"), vec![json!(0), json!(1)], vec![absent()]),
        case("a pool needs a replenishment", POOL_BODY, b("/replenishment"), vec![], vec![absent()]),
        case("a pool needs a template", POOL_BODY, b("/microvm_template"), vec![], vec![absent()]),
        case(
            "size is 0..=MAX_POOL_SIZE (an integral float is an integer)",
            POOL_BODY,
            b("/size"),
            vec![json!(0), json!(MAX_POOL_SIZE), json!(1.0)],
            vec![json!(-1), json!(MAX_POOL_SIZE + 1)],
        ),
        case(
            "flintlock_hosts are names, each once",
            POOL_BODY,
            b("/flintlock_hosts"),
            vec![json!([]), json!([SIM_HOST])],
            vec![json!([SIM_HOST, SIM_HOST]), json!(["Sim"])],
        ),
        case(
            "a strategy is one of three",
            POOL_BODY,
            b("/replenishment/strategy"),
            vec![json!("IMMEDIATE_ON_LEASE"), json!("REPLACE_ON_DELETE")],
            vec![json!("SOMETIMES"), absent()],
        ),
        Case {
            given: &[
                (At::Body("/replenishment/strategy"), || json!("MIN_SIZE_THRESHOLD")),
                (At::Body("/size"), || json!(MAX_POOL_SIZE)),
            ],
            ..case(
                "MIN_SIZE_THRESHOLD needs min_size 1..=MAX_POOL_SIZE",
                POOL_BODY,
                b("/replenishment/min_size"),
                vec![json!(1), json!(MAX_POOL_SIZE)],
                vec![json!(0), json!(MAX_POOL_SIZE + 1), absent(), json!(null)],
            )
        },
        case(
            "the other strategies take no min_size",
            POOL_BODY,
            b("/replenishment/min_size"),
            vec![absent(), json!(null)],
            vec![json!(1)],
        ),
        case(
            "at most MAX_COMMANDS create_commands",
            POOL_BODY,
            b("/create_commands"),
            vec![json!([]), json!(vec!["true"; MAX_COMMANDS])],
            vec![json!(vec!["true"; MAX_COMMANDS + 1])],
        ),
        case(
            "a create command is not blank and at most MAX_COMMAND_CHARS",
            POOL_BODY,
            b("/create_commands"),
            vec![json!([" x "]), json!(["é".repeat(MAX_COMMAND_CHARS)])],
            vec![json!([""]), json!([" \t\n\u{85}\u{3000}"]), json!(["x".repeat(MAX_COMMAND_CHARS + 1)])],
        ),
        case(
            "at most MAX_COMMANDS pre_lease_commands, not blank, at most MAX_COMMAND_CHARS",
            POOL_BODY,
            b("/pre_lease_commands"),
            vec![json!(vec!["true"; MAX_COMMANDS]), json!(["x".repeat(MAX_COMMAND_CHARS)])],
            vec![json!(vec!["true"; MAX_COMMANDS + 1]), json!(["  "]), json!(["x".repeat(MAX_COMMAND_CHARS + 1)])],
        ),
        case(
            "a hook failure policy is one of two",
            POOL_BODY,
            b("/hook_failure_policy"),
            vec![json!("QUARANTINE"), json!("DELETE_AND_REPLACE")],
            vec![json!("RETRY")],
        ),
        case(
            "heartbeat_interval_seconds >= 1",
            POOL_BODY,
            b("/heartbeat_interval_seconds"),
            vec![json!(1)],
            vec![json!(0)],
        ),
        Case {
            given: &[(At::Body("/heartbeat_interval_seconds"), || json!(1))],
            ..case(
                "heartbeat_expiry_seconds >= 1",
                POOL_BODY,
                b("/heartbeat_expiry_seconds"),
                vec![json!(1)],
                vec![json!(0)],
            )
        },
        // Issue 25 item 2.
        case(
            "max_lease_seconds is 1..=MAX_LEASE_SECONDS or null",
            POOL_BODY,
            b("/max_lease_seconds"),
            vec![json!(1), json!(poolmgr_core::domain::MAX_LEASE_SECONDS), json!(null), absent()],
            vec![json!(0), json!(poolmgr_core::domain::MAX_LEASE_SECONDS + 1)],
        ),
        // Autoscaling (issue 22).
        case(
            "autoscaling is a block or null",
            POOL_BODY,
            b("/autoscaling"),
            vec![json!(null), absent(), json!({"min": 0, "max": 1, "buffer": 0})],
            vec![json!(1), json!("on")],
        ),
        Case {
            given: &[(At::Body("/autoscaling"), || json!({"min": 0, "max": MAX_POOL_SIZE, "buffer": 0}))],
            ..case(
                "autoscaling.min is 0..=MAX_POOL_SIZE",
                POOL_BODY,
                b("/autoscaling/min"),
                vec![json!(0), json!(MAX_POOL_SIZE)],
                vec![json!(-1), json!(MAX_POOL_SIZE + 1), absent()],
            )
        },
        Case {
            given: &[(At::Body("/autoscaling"), || json!({"min": 0, "max": 1, "buffer": 0}))],
            ..case(
                "autoscaling.max is 1..=MAX_POOL_SIZE",
                POOL_BODY,
                b("/autoscaling/max"),
                vec![json!(1), json!(MAX_POOL_SIZE)],
                vec![json!(0), json!(MAX_POOL_SIZE + 1), absent()],
            )
        },
        Case {
            given: &[(At::Body("/autoscaling"), || json!({"min": 0, "max": MAX_POOL_SIZE, "buffer": 0}))],
            ..case(
                "autoscaling.buffer is 0..=max",
                POOL_BODY,
                b("/autoscaling/buffer"),
                vec![json!(0), json!(MAX_POOL_SIZE)],
                vec![json!(-1), json!(MAX_POOL_SIZE + 1)],
            )
        },
        Case {
            given: &[(At::Body("/autoscaling"), || json!({"min": 0, "max": 10, "target_warm_ratio": 0.5}))],
            ..case(
                "autoscaling.target_warm_ratio is strictly between 0 and 1",
                POOL_BODY,
                b("/autoscaling/target_warm_ratio"),
                vec![json!(0.0001), json!(0.9999), json!(0.99)],
                vec![json!(0.0), json!(1.0), json!(0.00001), json!(0.99999)],
            )
        },
        Case {
            given: &[(At::Body("/autoscaling"), || json!({"min": 0, "max": 10, "buffer": 1}))],
            ..case(
                "autoscaling.scale_down_stabilization_seconds is 0..=86400",
                POOL_BODY,
                b("/autoscaling/scale_down_stabilization_seconds"),
                vec![json!(0), json!(86_400), absent()],
                vec![json!(-1), json!(86_401)],
            )
        },
        // Rollouts (issue 24).
        case(
            "rollout is a block or null",
            POOL_BODY,
            b("/rollout"),
            vec![json!(null), absent(), json!({}), json!({"max_surge": 1, "auto_rollback": false})],
            vec![json!(1), json!("on"), json!({"surge": 1})],
        ),
        Case {
            given: &[(At::Body("/rollout"), || json!({"max_unavailable": 1}))],
            ..case(
                "rollout.max_surge is a count 0..=MAX_POOL_SIZE or a percentage 0%..=100%",
                POOL_BODY,
                b("/rollout/max_surge"),
                vec![json!(0), json!(MAX_POOL_SIZE), json!("0%"), json!("25%"), json!("100%"), absent()],
                vec![
                    json!(-1),
                    json!(MAX_POOL_SIZE + 1),
                    json!("101%"),
                    json!("25"),
                    json!("x%"),
                    json!("025%"),
                    json!(1.5),
                    json!(true),
                ],
            )
        },
        Case {
            given: &[(At::Body("/rollout"), || json!({"max_surge": 1}))],
            ..case(
                "rollout.max_unavailable is a count 0..=MAX_POOL_SIZE or a percentage 0%..=100%",
                POOL_BODY,
                b("/rollout/max_unavailable"),
                vec![json!(0), json!(MAX_POOL_SIZE), json!("0%"), json!("100%"), absent()],
                vec![json!(-1), json!(MAX_POOL_SIZE + 1), json!("101%"), json!("5"), json!(null)],
            )
        },
        Case {
            given: &[(At::Body("/rollout"), || json!({}))],
            ..case(
                "rollout.claim_preference is CURRENT or ANY",
                POOL_BODY,
                b("/rollout/claim_preference"),
                vec![json!("CURRENT"), json!("ANY"), absent()],
                vec![json!("current"), json!("NEWEST")],
            )
        },
        Case {
            given: &[(At::Body("/rollout"), || json!({}))],
            ..case(
                "rollout.window_seconds is 0..=86400",
                POOL_BODY,
                b("/rollout/window_seconds"),
                vec![json!(0), json!(86_400), absent()],
                vec![json!(-1), json!(86_401)],
            )
        },
        Case {
            given: &[(At::Body("/rollout"), || json!({}))],
            ..case(
                "rollout.progress_deadline_seconds is 1..=86400",
                POOL_BODY,
                b("/rollout/progress_deadline_seconds"),
                vec![json!(1), json!(86_400), absent()],
                vec![json!(0), json!(86_401)],
            )
        },
        Case {
            given: &[(At::Body("/rollout"), || json!({}))],
            ..case(
                "rollout.failure_threshold is 1..=200",
                POOL_BODY,
                b("/rollout/failure_threshold"),
                vec![json!(1), json!(200), absent()],
                vec![json!(0), json!(201)],
            )
        },
        // The template.
        case(
            "vcpu in flintlock's range",
            POOL_BODY,
            b("/microvm_template/vcpu"),
            vec![json!(null), json!(VCPU.0), json!(VCPU.1), json!(f64::from(VCPU.1))],
            vec![json!(VCPU.0 - 1), json!(VCPU.1 + 1), json!(1.5)],
        ),
        case(
            "memory_in_mb in flintlock's range",
            POOL_BODY,
            b("/microvm_template/memory_in_mb"),
            vec![json!(null), json!(MEMORY_IN_MB.0), json!(MEMORY_IN_MB.1)],
            vec![json!(MEMORY_IN_MB.0 - 1), json!(MEMORY_IN_MB.1 + 1)],
        ),
        case(
            "a provider flintlock knows",
            POOL_BODY,
            b("/microvm_template/provider"),
            vec![json!(null), json!("firecracker"), json!("cloudhypervisor")],
            vec![json!("qemu")],
        ),
        case(
            "a kernel image is not blank",
            POOL_BODY,
            b("/microvm_template/kernel/image"),
            vec![json!("k")],
            vec![json!(" "), absent()],
        ),
        case(
            "a kernel names its file",
            POOL_BODY,
            b("/microvm_template/kernel/filename"),
            vec![json!("v"), json!(" ")],
            vec![json!(""), absent(), json!(null)],
        ),
        case(
            "a root volume or an initrd",
            POOL_BODY,
            b("/microvm_template/root_volume"),
            vec![],
            vec![absent(), json!(null)],
        ),
        case(
            "an initrd image is not blank",
            POOL_BODY,
            b("/microvm_template/initrd"),
            vec![json!({"image": "i"}), json!(null)],
            vec![json!({"image": "\u{a0}"}), json!({})],
        ),
        case(
            "the root volume is a container image",
            POOL_BODY,
            b("/microvm_template/root_volume/source"),
            vec![json!({"container_source": "img"}), json!({"container_source": "img", "virtiofs_source": null})],
            vec![
                json!({}),
                json!({"container_source": " "}),
                json!({"container_source": "img", "virtiofs_source": "/srv/share"}),
            ],
        ),
        case(
            "the root volume has a source",
            POOL_BODY,
            b("/microvm_template/root_volume/source"),
            vec![],
            vec![absent()],
        ),
        Case {
            given: &[(At::Body("/microvm_template/provider"), || json!("cloudhypervisor"))],
            ..case(
                "an additional volume has exactly one source",
                POOL_BODY,
                b("/microvm_template/additional_volumes"),
                vec![
                    json!([volume(json!({"container_source": "img"}))]),
                    json!([volume(json!({"virtiofs_source": "/srv/share", "container_source": null}))]),
                ],
                vec![
                    json!([volume(json!({}))]),
                    json!([volume(json!({"container_source": "\t"}))]),
                    json!([volume(json!({"virtiofs_source": " "}))]),
                    json!([volume(json!({"container_source": "img", "virtiofs_source": "/srv/share"}))]),
                    json!([{"id": "data"}]),
                ],
            )
        },
        case(
            "a template has an interface",
            POOL_BODY,
            b("/microvm_template/interfaces"),
            vec![json!([{"device_id": "eth1"}])],
            vec![json!([]), absent()],
        ),
        Case {
            given: &[(At::Body("/microvm_template/interfaces/0/type"), || json!("MACVTAP"))],
            ..case(
                "MACVTAP needs a provider other than firecracker",
                POOL_BODY,
                b("/microvm_template/provider"),
                vec![json!("cloudhypervisor")],
                vec![json!("firecracker"), json!(null)],
            )
        },
        Case {
            given: &[(At::Body("/microvm_template/additional_volumes"), || {
                json!([volume(json!({"virtiofs_source": "/srv/share"}))])
            })],
            ..case(
                "virtiofs needs a provider other than firecracker",
                POOL_BODY,
                b("/microvm_template/provider"),
                vec![json!("cloudhypervisor")],
                vec![json!("firecracker"), absent()],
            )
        },
        case(
            "a device_id as flintlock wants it",
            POOL_BODY,
            b("/microvm_template/interfaces/0/device_id"),
            vec![json!("e"), json!("eth_0")],
            vec![json!("0eth"), json!("Eth1"), json!(""), absent()],
        ),
        case(
            "an interface type is TAP or MACVTAP",
            POOL_BODY,
            b("/microvm_template/interfaces/0/type"),
            vec![json!("TAP")],
            vec![json!("VETH")],
        ),
        case(
            "a guest MAC, or empty",
            POOL_BODY,
            b("/microvm_template/interfaces/0/guest_mac"),
            vec![json!(""), json!(null), json!("aa:BB:cc:00:11:ff")],
            vec![json!("aa:bb:cc:00:11"), json!("aa-bb-cc-00-11-22"), json!("aa:bb:cc:00:11:fg")],
        ),
        case(
            "a static address in CIDR form, its gateway too, nameservers are IPs",
            POOL_BODY,
            b("/microvm_template/interfaces/0/address"),
            vec![
                json!({"address": "10.0.0.2/32"}),
                json!({"address": "fd00::2/128", "gateway": "fd00::1/64", "nameservers": ["1.1.1.1", "::ffff:1.2.3.4"]}),
            ],
            vec![
                json!({"address": "10.0.0.2/33"}),
                json!({"address": "10.0.0.2"}),
                json!({"address": "fd00::2/129"}),
                json!({"address": "10.0.0.2/24", "gateway": "10.0.0.1"}),
                json!({"address": "10.0.0.2/24", "nameservers": ["1.1.1"]}),
                json!({}),
            ],
        ),
        case(
            "overrides need a bridge",
            POOL_BODY,
            b("/microvm_template/interfaces/0/overrides"),
            vec![json!(null), json!({"bridge_name": "br0"})],
            vec![json!({}), json!({"bridge_name": ""}), json!({"bridge_name": null})],
        ),
        // HostSpec, through POST and PUT.
        name_rule("a host's name", &[PostHost], b("/name")),
        case("a host needs a name to be created", &[PostHost], b("/name"), vec![], vec![absent(), json!(null)]),
        case(
            "a host's name may match the path",
            &[PutHost],
            b("/name"),
            vec![json!("spare"), json!(null)],
            vec![json!("Spare")],
        ),
        case(
            "a host address is host:port",
            HOST_BODY,
            b("/address"),
            vec![json!("h:1"), json!("[::1]:65535"), json!(format!("{}:9", "h".repeat(MAX_HOST_ADDRESS_CHARS - 2)))],
            vec![
                json!("h:0"),
                json!("h:65536"),
                json!("h:09"),
                json!("http://h:9"),
                json!("h 1:9"),
                json!("hé:9"),
                json!(format!("{}:9", "h".repeat(MAX_HOST_ADDRESS_CHARS - 1))),
                absent(),
            ],
        ),
        // Issue 25 item 7: plaintext is never a default.
        case("a host needs tls to be created", &[PostHost], b("/tls"), vec![], vec![absent(), json!(null)]),
        case("a PUT without tls keeps the host's", &[PutHost], b("/tls"), vec![absent(), json!(null)], vec![]),
        case(
            "TLS: insecure, or a CA with an optional certificate and key",
            HOST_BODY,
            b("/tls"),
            vec![
                json!({"insecure": true}),
                json!({"ca_pem": pem()}),
                json!({"insecure": false, "ca_pem": pem(), "cert_pem": pem(), "key_pem": pem()}),
                json!({"ca_pem": format!("-----BEGIN {}", "x".repeat(MAX_PEM_CHARS - 11))}),
            ],
            vec![
                json!({}),
                json!({"insecure": false}),
                json!({"insecure": true, "ca_pem": pem()}),
                json!({"ca_pem": pem(), "cert_pem": pem()}),
                json!({"ca_pem": pem(), "key_pem": pem()}),
                json!({"ca_pem": "not a pem"}),
                json!({"ca_pem": "-----BEGIN é"}),
                json!({"ca_pem": pem(), "cert_pem": "x", "key_pem": pem()}),
                json!({"ca_pem": pem(), "cert_pem": pem(), "key_pem": "x"}),
                json!({"ca_pem": format!("-----BEGIN {}", "x".repeat(MAX_PEM_CHARS - 10))}),
                json!({"ca_pem": pem(), "cert_pem": format!("-----BEGIN {}", "x".repeat(MAX_PEM_CHARS - 10)), "key_pem": pem()}),
                json!({"ca_pem": pem(), "cert_pem": pem(), "key_pem": format!("-----BEGIN {}", "x".repeat(MAX_PEM_CHARS - 10))}),
            ],
        ),
        case(
            "a basic auth token has 1..=1024 characters, none a control character",
            HOST_BODY,
            b("/basic_auth_token"),
            vec![json!(null), json!("t"), json!("é".repeat(MAX_BASIC_AUTH_TOKEN_CHARS))],
            vec![json!(""), s(MAX_BASIC_AUTH_TOKEN_CHARS + 1, 't'), json!("t\u{7f}"), json!("t\u{85}")],
        ),
        case(
            "exec is auto, enabled or disabled",
            HOST_BODY,
            b("/exec"),
            vec![json!("auto"), json!("enabled"), json!("disabled")],
            vec![json!("maybe")],
        ),
        case(
            "a cordon's body is optional: null, or an object",
            &[Cordon],
            b(""),
            vec![json!(null), json!({})],
            vec![json!([]), json!("maintenance")],
        ),
        case(
            "a cordon reason has at most 1024 characters",
            &[Cordon],
            b("/reason"),
            vec![json!(null), json!("é".repeat(MAX_CORDON_REASON_CHARS))],
            vec![s(MAX_CORDON_REASON_CHARS + 1, 'r')],
        ),
        // Paths.
        name_rule("a pool namespace in a path", &[GetPool, DeletePool], At::Path("namespace")),
        name_rule("a pool name in a path", &[GetPool, DeletePool], At::Path("name")),
        case(
            "a host name in a path",
            &[PutHost, GetHost, Cordon, Uncordon],
            At::Path("name"),
            vec![json!("spare")],
            vec![json!("Spare"), json!("-spare")],
        ),
        case("a host name in a path", &[DeleteHost], At::Path("name"), vec![json!("gone")], vec![json!("Gone")]),
        case(
            "a lease id",
            &[GetLease, Heartbeat, Release],
            At::Path("lease_id"),
            vec![json!(long_lease())],
            vec![s(MAX_LEASE_ID_CHARS + 1, 'a'), json!("a_b")],
        ),
        // Queries.
        filter_rule("a namespace filter", &[ListPools, ListVms, Events], At::Query("namespace")),
        filter_rule("a pool filter", &[ListVms, Events], At::Query("pool")),
        Case {
            given: &[(At::Query("pool"), || json!("ci"))],
            ..case(
                "a namespace filter",
                &[ListLeases],
                At::Query("namespace"),
                vec![json!("a"), name63.clone()],
                vec![json!("A")],
            )
        },
        Case {
            given: &[(At::Query("namespace"), || json!("default"))],
            ..case(
                "a pool filter",
                &[ListLeases],
                At::Query("pool"),
                vec![json!("a"), name63.clone()],
                vec![json!("A")],
            )
        },
        case(
            "page_size 1..=MAX_PAGE_SIZE",
            &[ListLeases, ListPools, ListVms],
            At::Query("page_size"),
            vec![json!(1), json!(MAX_PAGE_SIZE)],
            vec![json!(0), json!(MAX_PAGE_SIZE + 1)],
        ),
        case(
            "a page token is base64url, at most MAX_PAGE_TOKEN_CHARS",
            &[ListLeases],
            At::Query("page_token"),
            vec![json!(""), json!(base64url(&long_lease()))],
            vec![json!(format!("{}A", base64url(&"a".repeat(MAX_PAGE_KEY_CHARS)))), json!("YWFh+")],
        ),
        case(
            "a pools page token is base64url of a pool key, at most MAX_PAGE_TOKEN_CHARS",
            &[ListPools],
            At::Query("page_token"),
            vec![json!(""), json!(base64url(&format!("{}/{}", "a".repeat(63), "b".repeat(63))))],
            vec![json!(format!("{}A", base64url(&"a".repeat(MAX_PAGE_KEY_CHARS)))), json!("YWFh+")],
        ),
        case(
            "a VMs page token is base64url of a VM id, at most MAX_PAGE_TOKEN_CHARS",
            &[ListVms],
            At::Query("page_token"),
            vec![json!(""), json!(base64url(&"a".repeat(MAX_PAGE_KEY_CHARS)))],
            vec![json!(format!("{}A", base64url(&"a".repeat(MAX_PAGE_KEY_CHARS)))), json!("YWFh+")],
        ),
        case(
            "a phase filter",
            &[ListVms],
            At::Query("phase"),
            vec![json!(""), json!(Phase::Failed.as_str())],
            vec![json!("SLEEPING"), json!("leased")],
        ),
        case("after >= 0", &[Events], At::Query("after"), vec![json!(0)], vec![json!(-1)]),
        case(
            "limit 1..=MAX_EVENTS_LIMIT",
            &[Events],
            At::Query("limit"),
            vec![json!(1), json!(MAX_EVENTS_LIMIT)],
            vec![json!(0), json!(MAX_EVENTS_LIMIT + 1)],
        ),
        case(
            "wait_seconds 0..=MAX_EVENTS_WAIT_SECONDS",
            &[Events],
            At::Query("wait_seconds"),
            vec![json!(0), json!(MAX_EVENTS_WAIT_SECONDS)],
            vec![json!(-1), json!(MAX_EVENTS_WAIT_SECONDS + 1)],
        ),
    ]
}

fn base64url(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
}

/// What the cases need: pool default/ci without VMs, hosts `spare` and `gone`, a lease with
/// the longest id (one per lease route that ends it) and an event, so a long-poll answers at
/// once.
async fn fixture() -> TestApp {
    // The spec policy (issue 25) allows what the template's rules accept; `spec_policy` tests it.
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_POLICY_VIRTIOFS_PATHS".into(), "/srv/share".into()));
        env.push(("POOLMGR_POLICY_BRIDGES".into(), "br0".into()));
    })
    .await;
    app.create_pool("ci", 1).await;
    app.create_pool("ev", 1).await;
    app.seed_available("ev", 1).await;
    app.claimed(CLIENT_A, "ev", None).await;
    app.post(ADMIN, "/v1/hosts", json!({"name": "spare", "address": "127.0.0.1:9", "tls": {"insecure": true}}))
        .await
        .assert_ok(201);
    assert!(!app.events("").await.events.is_empty(), "a long-poll of the feed would wait");
    app
}

/// Seeds a LEASED VM of pool ci whose lease has the longest id a lease can have.
async fn seed_long_lease(app: &TestApp) {
    let vm = app.seed_vm("ci", Phase::Leased).await;
    let conn = app.conn().await;
    conn.execute(
        "INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at, principal)
         VALUES ($1, $2, 'default', 'ci', now(), now(), now() + interval '1 hour', 'client-a')",
        &[&long_lease(), &vm.id],
    )
    .await
    .unwrap();
    conn.execute("UPDATE vms SET lease_id = $1 WHERE id = $2", &[&long_lease(), &vm.id]).await.unwrap();
}

#[tokio::test]
async fn every_documented_request_rule_holds_at_its_boundaries_and_the_server_agrees() {
    let app = fixture().await;
    let doc = Doc(app.get(ADMIN, "/openapi.json").await.assert_ok(200).clone());
    let mut failures = vec![];
    let mut covered = BTreeSet::new();
    for c in cases() {
        for &op in c.ops {
            for (inside, values) in [(true, &c.inside), (false, &c.outside)] {
                for v in values {
                    op.prepare(&app).await;
                    let mut req = op.base();
                    for (at, given) in c.given {
                        req.set(*at, given());
                    }
                    req.set(c.at, v.clone());
                    let (valid, sites) = doc.check(&req);
                    let r = req.send(&app).await;
                    let (_, _, _, accepted) = op.spec();
                    let refused = op.refused(c.at);
                    let served = accepted.contains(&r.status.as_u16());
                    if served {
                        op.undo(&app, &req).await;
                    }
                    let what = format!("{} ({op:?} {:?} = {})", c.what, c.at, short(v));
                    if valid != inside {
                        failures.push(format!(
                            "{what}: the document says {} ({sites:?})",
                            if valid { "valid" } else { "invalid" }
                        ));
                    }
                    if inside && !served {
                        failures
                            .push(format!("{what}: inside the rule, but the server answered {} {}", r.status, r.body));
                    }
                    if !inside && r.status.as_u16() != refused {
                        failures
                            .push(format!("{what}: outside the rule, but the server answered {} {}", r.status, r.body));
                    }
                    if !inside {
                        covered.extend(sites);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "the document and the server disagree:\n{}", failures.join("\n"));

    // Every field of every base body, left out: the document calls it optional exactly when
    // the server accepts the body without it (a default the validator refuses is a rule too).
    for &op in ALL {
        let Some(body) = op.base().body else { continue };
        let mut fields = vec![];
        members(&body, "", &mut fields);
        for ptr in fields {
            op.prepare(&app).await;
            let mut req = op.base();
            req.set(At::Body(Box::leak(ptr.clone().into_boxed_str())), absent());
            let (valid, sites) = doc.check(&req);
            let r = req.send(&app).await;
            let served = op.spec().3.contains(&r.status.as_u16());
            if served {
                op.undo(&app, &req).await;
            }
            if valid != served {
                failures.push(format!(
                    "{op:?} without {ptr}: the document says {} ({sites:?}), the server answered {} {}",
                    if valid { "valid" } else { "invalid" },
                    r.status,
                    r.body
                ));
            }
        }
    }
    assert!(failures.is_empty(), "the document and the server disagree on optional fields:\n{}", failures.join("\n"));

    let mut documented = BTreeSet::new();
    for &op in ALL {
        doc.sites(op, &mut documented);
    }
    let untested: Vec<&String> = documented.difference(&covered).collect();
    assert!(untested.is_empty(), "documented rules no case here refuses a value of:\n{untested:#?}");
}

/// The JSON pointer of every member of every object in `v`.
fn members(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            for (k, sub) in o {
                let ptr = format!("{at}/{k}");
                out.push(ptr.clone());
                members(sub, &ptr, out);
            }
        }
        Value::Array(a) => {
            for (i, sub) in a.iter().enumerate() {
                members(sub, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    let n = s.chars().count();
    if n > 60 { format!("{}… ({n} chars)", s.chars().take(50).collect::<String>()) } else { s }
}

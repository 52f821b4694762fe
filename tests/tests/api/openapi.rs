//! The OpenAPI document served at `/openapi.json` is the Router's: every documented operation
//! is routed (by `router` and by exactly the Lambda function API Gateway sends it to), the
//! document names exactly the contract's routes, and what the service really answers —
//! successes and errors of every resource — validates against the document's response
//! schemas, with response objects closed so an undocumented field fails too.

use std::collections::{BTreeMap, BTreeSet};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use poolmgr_core::domain::Phase;
use poolmgr_core::http;
use poolmgr_tests::*;
use serde_json::{Value, json};
use tower::ServiceExt;

/// The contract's routes (`shared/http-api.md`, "Routes"), plus this document.
const CONTRACT_ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/claims"),
    ("GET", "/v1/leases/{lease_id}"),
    ("POST", "/v1/leases/{lease_id}/heartbeat"),
    ("DELETE", "/v1/leases/{lease_id}"),
    ("GET", "/v1/leases"),
    ("POST", "/v1/pools"),
    ("GET", "/v1/pools"),
    ("GET", "/v1/pools/{namespace}/{name}"),
    ("PUT", "/v1/pools/{namespace}/{name}"),
    ("DELETE", "/v1/pools/{namespace}/{name}"),
    ("POST", "/v1/pools/{namespace}/{name}/expect"),
    ("GET", "/v1/pools/{namespace}/{name}/revisions"),
    ("POST", "/v1/pools/{namespace}/{name}/rollout/pause"),
    ("POST", "/v1/pools/{namespace}/{name}/rollout/resume"),
    ("POST", "/v1/pools/{namespace}/{name}/rollout/undo"),
    ("GET", "/v1/vms"),
    ("GET", "/v1/vms/{id}"),
    // Issue 14 item 5: an operator discards a VM.
    ("DELETE", "/v1/vms/{id}"),
    ("POST", "/v1/hosts"),
    ("GET", "/v1/hosts"),
    ("GET", "/v1/hosts/{name}"),
    ("PUT", "/v1/hosts/{name}"),
    ("DELETE", "/v1/hosts/{name}"),
    ("POST", "/v1/hosts/{name}/cordon"),
    ("POST", "/v1/hosts/{name}/uncordon"),
    ("GET", "/v1/events"),
    // Issue 25 item 2: client scopes and quotas (beyond the contract's table).
    ("GET", "/v1/principals"),
    ("GET", "/v1/principals/{name}"),
    ("PUT", "/v1/principals/{name}"),
    ("DELETE", "/v1/principals/{name}"),
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    // Issue 13: the process probes.
    ("GET", "/livez"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
];

/// Operations that need no token.
const OPEN: &[&str] = &["/healthz", "/livez", "/readyz", "/openapi.json"];

/// The probes every Router serves (each function answers them itself); API Gateway sends
/// them to the pools function, like `/healthz`.
const PROBES: &[&str] = &["/healthz", "/livez", "/readyz"];

const NO_ROUTE: &str = "no such route: see the HTTP API reference";

/// The served document, and a copy whose response objects are closed for validation.
struct Doc {
    served: Value,
    strict: Value,
}

impl Doc {
    async fn fetch(app: &TestApp) -> Doc {
        let r = app.request(Method::GET, "/openapi.json", None, None, &[]).await;
        assert_eq!(r.status.as_u16(), 200, "/openapi.json needs no token: {}", r.body);
        assert_eq!(content_type(&r), Some("application/json".into()));
        Doc::new(r.body)
    }

    fn new(served: Value) -> Doc {
        assert!(served["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "not OpenAPI 3: {served}");
        let mut strict = served.clone();
        // Any object schema with named properties and nothing said about others gets
        // additionalProperties: false, so a field the service sends but the document does not
        // name fails validation (request objects are closed in the document already).
        for schema in strict["components"]["schemas"].as_object_mut().expect("components.schemas").values_mut() {
            if schema.get("properties").is_some() && schema.get("additionalProperties").is_none() {
                schema["additionalProperties"] = json!(false);
            }
        }
        Doc { served, strict }
    }

    /// Every documented (method, path).
    fn operations(&self) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for (path, item) in self.served["paths"].as_object().expect("paths") {
            for method in item.as_object().unwrap().keys() {
                if ["get", "put", "post", "delete", "patch", "head", "options", "trace"].contains(&method.as_str()) {
                    out.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        out
    }

    fn operation(&self, method: &Method, path: &str) -> &Value {
        let op = &self.served["paths"][path][method.as_str().to_lowercase()];
        assert!(op.is_object(), "{method} {path} is not in the document");
        op
    }

    /// What is wrong with `resp` as an answer of `method path` according to the document.
    fn violations(&self, method: &Method, path: &str, resp: &TestResponse) -> Vec<String> {
        let op = self.operation(method, path);
        let status = resp.status.as_u16().to_string();
        let Some(documented) = op["responses"].get(&status) else {
            return vec![format!(
                "status {status} is not documented (documented: {:?})",
                op["responses"].as_object().unwrap().keys().collect::<Vec<_>>()
            )];
        };
        let Some(content) = documented.get("content").and_then(Value::as_object) else {
            return if resp.body.is_null() {
                vec![]
            } else {
                vec![format!("a {status} has no documented body, got {}", resp.body)]
            };
        };
        let Some(ct) = content_type(resp) else { return vec![format!("a {status} has no content-type")] };
        if !content.contains_key(&ct) {
            return vec![format!(
                "content-type {ct} is not documented for {status} (documented: {:?})",
                content.keys().collect::<Vec<_>>()
            )];
        }
        if ct != "application/json" {
            return vec![];
        }
        self.schema_violations(&content[&ct]["schema"], &resp.body)
    }

    /// `instance` validated against `schema`, a schema of the document whose `$ref`s point
    /// into the strict document's components.
    fn schema_violations(&self, schema: &Value, instance: &Value) -> Vec<String> {
        let mut root = schema.clone();
        root["components"] = self.strict["components"].clone();
        let validator = jsonschema::draft202012::options().build(&root).expect("the document's schemas compile");
        validator.iter_errors(instance).map(|e| format!("{} at {}", e, e.instance_path())).collect()
    }

    /// Panics unless `resp` is a documented answer of `method path`.
    #[track_caller]
    fn check(&self, method: Method, path: &str, resp: &TestResponse) {
        let v = self.violations(&method, path, resp);
        assert!(
            v.is_empty(),
            "{method} {path} answered {} {} which the document does not describe: {v:#?}",
            resp.status,
            resp.body
        );
    }
}

fn content_type(r: &TestResponse) -> Option<String> {
    let v = r.headers.get("content-type")?.to_str().ok()?;
    Some(v.split(';').next().unwrap_or("").trim().to_owned())
}

/// `path` with every `{param}` replaced by a harmless value.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|seg| if seg.starts_with('{') && seg.ends_with('}') { "x0" } else { seg })
        .collect::<Vec<_>>()
        .join("/")
}

/// Whether `router` has a route for `method path` (not the fallback 404, not a 405). Sent
/// without a token, so nothing changes.
async fn routes(router: &Router, method: &str, path: &str) -> bool {
    let req = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(concrete(path))
        .body(Body::empty())
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    !(status == 405 || (status == 404 && body["error"]["message"] == json!(NO_ROUTE)))
}

#[tokio::test]
async fn the_document_names_exactly_the_contract_routes_and_router_serves_each() {
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;
    let documented = doc.operations();
    let contract: BTreeSet<(String, String)> =
        CONTRACT_ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    assert_eq!(documented, contract, "documented operations differ from the contract's routes");
    for (method, path) in &documented {
        assert!(routes(&app.router, method, path).await, "{method} {path} is documented but not routed");
    }
    // And the probe can tell: an undocumented method and path are not routed.
    assert!(!routes(&app.router, "PATCH", "/v1/pools").await);
    assert!(!routes(&app.router, "GET", "/v1/nothing").await);
}

#[tokio::test]
async fn every_operation_needs_a_token_except_health_and_the_document() {
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;
    assert_eq!(
        doc.served["components"]["securitySchemes"]["bearer"],
        json!({
            "type": "http", "scheme": "bearer",
            "description": "`Authorization: Bearer <token>`; an `admin`, `viewer` or `client` token (each route says which roles it takes)"
        })
    );
    for (method, path) in doc.operations() {
        let op = doc.operation(&Method::from_bytes(method.as_bytes()).unwrap(), &path);
        let open = OPEN.contains(&path.as_str());
        assert_eq!(op.get("security").is_none(), open, "{method} {path}: security {:?}", op.get("security"));
        if !open {
            assert_eq!(op["security"], json!([{"bearer": []}]), "{method} {path}");
            // Really refused without a token, in the documented shape.
            let r =
                app.request(Method::from_bytes(method.as_bytes()).unwrap(), &concrete(&path), None, None, &[]).await;
            r.assert_error(401, "UNAUTHENTICATED");
            doc.check(Method::from_bytes(method.as_bytes()).unwrap(), &path, &r);
        }
    }
}

#[tokio::test]
async fn each_lambda_function_routes_what_api_gateway_sends_it() {
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;
    let functions: [(&str, Router); 5] = [
        ("Claims", http::claims_router(app.state.clone())),
        ("Leases", http::leases_router(app.state.clone())),
        ("Pools", http::pools_router(app.state.clone())),
        ("Hosts", http::hosts_router(app.state.clone())),
        ("Events", http::events_router(app.state.clone())),
    ];
    let events = template_http_events();
    for (method, path) in doc.operations() {
        if PROBES.contains(&path.as_str()) {
            for (f, router) in &functions {
                assert!(routes(router, &method, &path).await, "the {f} function does not route {method} {path}");
            }
        }
        // The function the SAM template sends this route to.
        let owners: Vec<&String> =
            events.iter().filter(|(_, ops)| ops.contains(&(method.clone(), path.clone()))).map(|(f, _)| f).collect();
        assert_eq!(
            owners.len(),
            1,
            "{method} {path} must be an HttpApi event of exactly one function in infra/template.yaml: {owners:?}"
        );
        let owner = owners[0].trim_end_matches("Function");
        let (_, router) =
            functions.iter().find(|(f, _)| *f == owner).unwrap_or_else(|| panic!("no function router {owner}"));
        assert!(
            routes(router, &method, &path).await,
            "{method} {path} goes to the {owner} function, whose Router does not route it"
        );
    }
    // Every HttpApi event with a path is a documented operation.
    for (f, ops) in &events {
        for op in ops {
            assert!(doc.operations().contains(op), "{f} has HttpApi event {op:?} that the document does not name");
        }
    }
    // The pools function serves the same document.
    let pools = &functions[2].1;
    let resp = pools.clone().oneshot(Request::get("/openapi.json").body(Body::empty()).unwrap()).await.unwrap();
    let served: Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(served, doc.served);
}

/// `Method`/`Path` of every HttpApi event in `infra/template.yaml`, by function resource.
/// An HttpApi event without both is the `$default` route, which the template must not have:
/// an unmatched path would invoke a function.
fn template_http_events() -> BTreeMap<String, BTreeSet<(String, String)>> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../infra/template.yaml")).unwrap();
    let t: yaml_serde::Value = yaml_serde::from_str(&text).expect("infra/template.yaml is YAML");
    let mut out: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    for (name, r) in t["Resources"].as_mapping().expect("Resources") {
        let Some(events) = r["Properties"]["Events"].as_mapping() else { continue };
        for (event, e) in events {
            if e["Type"].as_str() != Some("HttpApi") {
                continue;
            }
            let (name, event) = (name.as_str().unwrap(), event.as_str().unwrap());
            let (Some(m), Some(p)) = (e["Properties"]["Method"].as_str(), e["Properties"]["Path"].as_str()) else {
                panic!("{name}.{event} is a $default route: every route must name its method and path")
            };
            out.entry(name.to_owned()).or_default().insert((m.to_owned(), p.to_owned()));
        }
    }
    assert!(out.len() >= 5, "found no HttpApi events in infra/template.yaml: {out:?}");
    out
}

#[tokio::test]
async fn real_answers_of_every_resource_validate_against_the_document() {
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;

    // Operations.
    for path in ["/healthz", "/livez", "/readyz"] {
        doc.check(Method::GET, path, app.request(Method::GET, path, None, None, &[]).await.assert_ok_response(200));
    }
    doc.check(Method::GET, "/openapi.json", &app.request(Method::GET, "/openapi.json", None, None, &[]).await);

    // Hosts.
    let spare = json!({"name": "spare", "address": "127.0.0.1:9", "tls": {"insecure": true}});
    let r = app.post(ADMIN, "/v1/hosts", spare.clone()).await;
    r.assert_ok(201);
    doc.check(Method::POST, "/v1/hosts", &r);
    let r = app.post(ADMIN, "/v1/hosts", spare.clone()).await;
    r.assert_error(409, "ALREADY_EXISTS");
    doc.check(Method::POST, "/v1/hosts", &r);
    let r = app.post(ADMIN, "/v1/hosts", json!({"name": "x", "address": "nope"})).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::POST, "/v1/hosts", &r);
    let r = app.post(CLIENT_A, "/v1/hosts", spare.clone()).await;
    r.assert_error(403, "PERMISSION_DENIED");
    doc.check(Method::POST, "/v1/hosts", &r);
    doc.check(Method::GET, "/v1/hosts", app.get(ADMIN, "/v1/hosts").await.assert_ok_response(200));
    doc.check(Method::GET, "/v1/hosts/{name}", app.get(ADMIN, "/v1/hosts/sim").await.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/hosts/nope").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::GET, "/v1/hosts/{name}", &r);
    let r = app.put(ADMIN, "/v1/hosts/spare", json!({"address": "127.0.0.1:10"})).await;
    doc.check(Method::PUT, "/v1/hosts/{name}", r.assert_ok_response(200));
    let r = app.post(ADMIN, "/v1/hosts/spare/cordon", json!({"reason": "maintenance"})).await;
    doc.check(Method::POST, "/v1/hosts/{name}/cordon", r.assert_ok_response(200));
    let r = app.request(Method::POST, "/v1/hosts/spare/cordon", Some(ADMIN), None, &[]).await;
    doc.check(Method::POST, "/v1/hosts/{name}/cordon", r.assert_ok_response(200));
    let r = app.request(Method::POST, "/v1/hosts/spare/uncordon", Some(ADMIN), None, &[]).await;
    doc.check(Method::POST, "/v1/hosts/{name}/uncordon", r.assert_ok_response(200));

    // Pools.
    let r = app.post(ADMIN, "/v1/pools", pool_spec("ci", 2)).await;
    doc.check(Method::POST, "/v1/pools", r.assert_ok_response(201));
    let r = app.post(ADMIN, "/v1/pools", pool_spec("ci", 2)).await;
    r.assert_error(409, "ALREADY_EXISTS");
    doc.check(Method::POST, "/v1/pools", &r);
    let mut unregistered = pool_spec("web", 1);
    unregistered["flintlock_hosts"] = json!(["ghost"]);
    let r = app.post(ADMIN, "/v1/pools", unregistered).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    doc.check(Method::POST, "/v1/pools", &r);
    app.create_pool("empty", 0).await;
    doc.check(Method::GET, "/v1/pools", app.get(ADMIN, "/v1/pools").await.assert_ok_response(200));
    doc.check(Method::GET, "/v1/pools", app.get(ADMIN, "/v1/pools?namespace=default").await.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/pools?namespace=NOPE").await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::GET, "/v1/pools", &r);
    let r = app.put(ADMIN, "/v1/pools/default/ci", pool_spec("ci", 3)).await;
    doc.check(Method::PUT, "/v1/pools/{namespace}/{name}", r.assert_ok_response(200));
    let r = app.put(ADMIN, "/v1/pools/default/nope", pool_spec("nope", 3)).await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::PUT, "/v1/pools/{namespace}/{name}", &r);

    // Claims and leases, on seeded AVAILABLE VMs.
    app.seed_available("ci", 2).await;
    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    doc.check(Method::POST, "/v1/claims", r.assert_ok_response(200));
    let lease_id = r.body["lease"]["lease_id"].as_str().unwrap().to_owned();
    let vm_id = r.body["vm"]["id"].as_str().unwrap().to_owned();
    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    assert_eq!(r.body["replayed"], json!(true));
    doc.check(Method::POST, "/v1/claims", r.assert_ok_response(200));
    let r = app.claim(CLIENT_A, "ci", None).await;
    doc.check(Method::POST, "/v1/claims", r.assert_ok_response(200));
    let r = app.claim(CLIENT_A, "empty", None).await;
    r.assert_error(429, "RESOURCE_EXHAUSTED");
    doc.check(Method::POST, "/v1/claims", &r);
    let r = app.claim(CLIENT_A, "nope", None).await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::POST, "/v1/claims", &r);
    let r = app.claim(CLIENT_A, "empty", Some("r-1")).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::POST, "/v1/claims", &r);
    let r = app.post(CLIENT_A, "/v1/claims", json!({"pool": "ci"})).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::POST, "/v1/claims", &r);

    let lease_path = format!("/v1/leases/{lease_id}");
    doc.check(Method::GET, "/v1/leases/{lease_id}", app.get(CLIENT_A, &lease_path).await.assert_ok_response(200));
    let r = app.heartbeat(CLIENT_A, &lease_id).await;
    doc.check(Method::POST, "/v1/leases/{lease_id}/heartbeat", r.assert_ok_response(200));
    doc.check(Method::GET, "/v1/leases", app.get(CLIENT_A, "/v1/leases").await.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/leases?namespace=default&pool=ci&page_size=1").await;
    assert!(!r.body["next_page_token"].as_str().unwrap().is_empty(), "two leases, pages of one: {}", r.body);
    doc.check(Method::GET, "/v1/leases", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/leases?namespace=default").await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::GET, "/v1/leases", &r);
    let r = app.get(CLIENT_A, "/v1/leases/00000000-0000-4000-8000-000000000000").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::GET, "/v1/leases/{lease_id}", &r);
    let r = app.heartbeat(CLIENT_A, "00000000-0000-4000-8000-000000000000").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::POST, "/v1/leases/{lease_id}/heartbeat", &r);

    // VMs: every phase the factories make.
    let quarantined = app.seed_vm("ci", Phase::Quarantined).await;
    let r = app.get(ADMIN, "/v1/vms").await;
    assert!(r.body["vms"].as_array().unwrap().len() >= 3, "{}", r.body);
    doc.check(Method::GET, "/v1/vms", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/vms?namespace=default&pool=ci&phase=LEASED").await;
    doc.check(Method::GET, "/v1/vms", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/vms?phase=SLEEPING").await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::GET, "/v1/vms", &r);
    doc.check(Method::GET, "/v1/vms/{id}", app.get(ADMIN, &format!("/v1/vms/{vm_id}")).await.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/vms/nope").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::GET, "/v1/vms/{id}", &r);

    // Metrics and events.
    let r = app.get(ADMIN, "/metrics").await;
    doc.check(Method::GET, "/metrics", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/events").await;
    assert!(!r.body["events"].as_array().unwrap().is_empty(), "{}", r.body);
    doc.check(Method::GET, "/v1/events", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/events?namespace=default&pool=ci&after=1&limit=2").await;
    doc.check(Method::GET, "/v1/events", r.assert_ok_response(200));
    let r = app.get(ADMIN, "/v1/events?limit=0").await;
    r.assert_error(400, "INVALID_ARGUMENT");
    doc.check(Method::GET, "/v1/events", &r);

    // Deletes.
    let r = app.delete(ADMIN, &format!("/v1/vms/{vm_id}")).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    doc.check(Method::DELETE, "/v1/vms/{id}", &r);
    let r = app.delete(ADMIN, &format!("/v1/vms/{}", quarantined.id)).await;
    doc.check(Method::DELETE, "/v1/vms/{id}", r.assert_ok_response(204));
    let r = app.delete(ADMIN, &format!("/v1/vms/{}", quarantined.id)).await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::DELETE, "/v1/vms/{id}", &r);
    let r = app.delete(ADMIN, "/v1/pools/default/ci").await;
    r.assert_error(400, "FAILED_PRECONDITION");
    doc.check(Method::DELETE, "/v1/pools/{namespace}/{name}", &r);
    let r = app.delete(ADMIN, "/v1/hosts/sim").await;
    r.assert_error(400, "FAILED_PRECONDITION");
    doc.check(Method::DELETE, "/v1/hosts/{name}", &r);
    let r = app.release(CLIENT_A, &lease_id).await;
    doc.check(Method::DELETE, "/v1/leases/{lease_id}", r.assert_ok_response(204));
    let r = app.release(CLIENT_A, &lease_id).await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::DELETE, "/v1/leases/{lease_id}", &r);
    let r = app.delete(ADMIN, "/v1/pools/default/ci?force=true").await;
    doc.check(Method::DELETE, "/v1/pools/{namespace}/{name}", r.assert_ok_response(204));
    let r = app.delete(ADMIN, "/v1/pools/default/ci").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::DELETE, "/v1/pools/{namespace}/{name}", &r);
    let r = app.delete(ADMIN, "/v1/hosts/spare").await;
    doc.check(Method::DELETE, "/v1/hosts/{name}", r.assert_ok_response(204));
    let r = app.delete(ADMIN, "/v1/hosts/spare").await;
    r.assert_error(404, "NOT_FOUND");
    doc.check(Method::DELETE, "/v1/hosts/{name}", &r);
}

#[tokio::test]
async fn a_wrong_method_answers_405_in_the_contract_error_shape() {
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;
    for (method, path) in [(Method::PATCH, "/v1/pools"), (Method::PUT, "/v1/claims"), (Method::POST, "/v1/leases/x0")] {
        let r = app.request(method.clone(), path, Some(ADMIN), None, &[]).await;
        r.assert_error(405, "UNIMPLEMENTED");
        assert_eq!(content_type(&r), Some("application/json".into()), "{method} {path}");
        assert!(r.headers.get("allow").is_some(), "{method} {path}: no Allow header");
        let v = doc.schema_violations(&json!({"$ref": "#/components/schemas/Error"}), &r.body);
        assert!(v.is_empty(), "{method} {path}: {} is not an Error: {v:?}", r.body);
    }
    let allow = app.request(Method::PATCH, "/v1/pools", Some(ADMIN), None, &[]).await.headers["allow"].clone();
    let mut allowed: Vec<&str> = allow.to_str().unwrap().split(',').map(str::trim).collect();
    allowed.sort();
    assert_eq!(allowed, ["GET", "HEAD", "POST"]);
}

#[tokio::test]
async fn validation_catches_undocumented_fields_statuses_and_types() {
    // The checks above must be able to fail: a real pool with a field removed, added or
    // retyped, and an undocumented status, are all reported.
    let app = TestApp::spawn().await;
    let doc = Doc::fetch(&app).await;
    let real = app.post(ADMIN, "/v1/pools", pool_spec("ci", 1)).await;
    let v = doc.violations(&Method::POST, "/v1/pools", &real);
    assert!(v.is_empty(), "{v:?}");
    let tamper = |f: &dyn Fn(&mut Value)| {
        let mut r = TestResponse { status: real.status, headers: real.headers.clone(), body: real.body.clone() };
        f(&mut r.body);
        doc.violations(&Method::POST, "/v1/pools", &r)
    };
    assert!(
        !tamper(&|b| {
            b.as_object_mut().unwrap().remove("status");
        })
        .is_empty(),
        "a missing field"
    );
    assert!(!tamper(&|b| b["status"]["surprise"] = json!(1)).is_empty(), "an undocumented field");
    assert!(!tamper(&|b| b["spec"]["size"] = json!("1")).is_empty(), "a wrong type");
    assert!(!tamper(&|b| b["spec"]["hook_failure_policy"] = json!("RETRY")).is_empty(), "an unknown enum value");
    let mut teapot = TestResponse { status: real.status, headers: real.headers.clone(), body: real.body.clone() };
    teapot.status = axum::http::StatusCode::IM_A_TEAPOT;
    assert!(!doc.violations(&Method::POST, "/v1/pools", &teapot).is_empty(), "an undocumented status");
    let mut text = TestResponse { status: real.status, headers: real.headers.clone(), body: real.body.clone() };
    text.headers.insert("content-type", "text/html".parse().unwrap());
    assert!(!doc.violations(&Method::POST, "/v1/pools", &text).is_empty(), "an undocumented content type");
}

/// Where the document is committed (`docs/api.md` points to it), relative to this crate.
const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");

/// The command that rewrites [`COMMITTED`] from the Router's document.
const REGENERATE: &str = "UPDATE_OPENAPI=1 cargo test -p poolmgr-tests --test api -- openapi::the_committed_document";

/// The document as committed: pretty-printed, keys in the served order, one final newline.
fn committed_text() -> String {
    let mut text = serde_json::to_string_pretty(http::document()).expect("the document serializes");
    let served: Value = serde_json::from_str(http::document_json()).expect("the served document is JSON");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), served, "the pretty document is the served one");
    text.push('\n');
    text
}

#[test]
fn the_committed_document_is_the_served_one() {
    let want = committed_text();
    if std::env::var_os("UPDATE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(COMMITTED, &want).expect("docs/openapi.json is writable");
        return;
    }
    let have = std::fs::read_to_string(COMMITTED).unwrap_or_default();
    if have != want {
        // The first line that differs, so the failure says what changed.
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(want.lines().count()));
        panic!(
            "docs/openapi.json is not the document the server serves (first difference at line {}: committed {:?}, served {:?}); \
             regenerate it with `{REGENERATE}` and commit it",
            line + 1,
            have.lines().nth(line).unwrap_or("<end of file>"),
            want.lines().nth(line).unwrap_or("<end of file>"),
        );
    }
}

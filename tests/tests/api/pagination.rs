//! `GET /v1/pools`, `/v1/hosts` and `/v1/vms` are paginated like `/v1/leases` (the contract;
//! issue 25 item 11): `page_size` (default 100, at most 1000), `page_token`, and a
//! `next_page_token` that is empty on the last page. Pages are keyset pages: following the
//! tokens visits every item exactly once, in the contract's order.

use poolmgr_tests::*;
use serde_json::{Value, json};

/// Follows `path`'s pages of `size`, collecting `key` of each item of `field`.
async fn walk(
    app: &TestApp,
    path: &str,
    field: &str,
    size: i64,
    key: impl Fn(&Value) -> String,
) -> (Vec<String>, usize) {
    let (mut keys, mut pages, mut token) = (Vec::new(), 0, String::new());
    let sep = if path.contains('?') { '&' } else { '?' };
    loop {
        let r = app.get(VIEWER, &format!("{path}{sep}page_size={size}&page_token={token}")).await;
        let body = r.assert_ok(200).clone();
        let items = body[field].as_array().unwrap_or_else(|| panic!("{path}: {body}"));
        assert!(items.len() as i64 <= size, "{path}: a page holds at most page_size");
        keys.extend(items.iter().map(&key));
        pages += 1;
        token = body["next_page_token"].as_str().unwrap().to_owned();
        if token.is_empty() {
            return (keys, pages);
        }
        assert!(pages < 100, "{path}: the pages never end");
    }
}

#[tokio::test]
async fn pools_hosts_and_vms_are_listed_in_pages_that_visit_each_once_in_order() {
    let app = TestApp::spawn().await;
    for (ns, name) in [("b", "one"), ("a", "two"), ("a", "one"), ("c", "x"), ("b", "two")] {
        let mut spec = pool_spec(name, 0);
        spec["namespace"] = json!(ns);
        app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    }
    let pool_key =
        |p: &Value| format!("{}/{}", p["spec"]["namespace"].as_str().unwrap(), p["spec"]["name"].as_str().unwrap());
    let want: Vec<String> = ["a/one", "a/two", "b/one", "b/two", "c/x"].map(String::from).to_vec();
    for size in [1, 2, 5, 1000] {
        let (keys, pages) = walk(&app, "/v1/pools", "pools", size, pool_key).await;
        assert_eq!(keys, want, "page_size {size}");
        assert_eq!(
            pages,
            want.len().div_ceil(size as usize),
            "page_size {size}: the last full page says it is the last"
        );
    }
    // A namespace filter pages within it.
    assert_eq!(walk(&app, "/v1/pools?namespace=b", "pools", 1, pool_key).await.0, ["b/one", "b/two"]);
    // The default page size is 100: all five in one page, no token.
    let r = app.get(VIEWER, "/v1/pools").await;
    assert_eq!((r.assert_ok(200)["pools"].as_array().unwrap().len(), &r.body["next_page_token"]), (5, &json!("")));

    // Hosts: the simulator plus three more, by name.
    for (name, port) in [("h-c", 1), ("h-a", 2), ("h-b", 3)] {
        app.post(
            ADMIN,
            "/v1/hosts",
            json!({"name": name, "address": format!("127.0.0.1:{}", 40000 + port), "tls": {"insecure": true}}),
        )
        .await
        .assert_ok(201);
    }
    let (hosts, _) = walk(&app, "/v1/hosts", "hosts", 2, |h| h["name"].as_str().unwrap().to_owned()).await;
    assert_eq!(hosts, ["h-a", "h-b", "h-c", SIM_HOST]);

    // VMs, by id, across pools.
    app.create_pool("ci", 7).await;
    let mut ids: Vec<String> = app.seed_available("ci", 7).await.into_iter().map(|v| v.id).collect();
    ids.sort();
    let (vms, pages) = walk(&app, "/v1/vms", "vms", 3, |v| v["id"].as_str().unwrap().to_owned()).await;
    assert_eq!((vms, pages), (ids, 3));
    let (filtered, _) = walk(&app, "/v1/vms?namespace=default&pool=ci&phase=AVAILABLE", "vms", 4, |v| {
        v["id"].as_str().unwrap().to_owned()
    })
    .await;
    assert_eq!(filtered.len(), 7);
}

#[tokio::test]
async fn bad_page_sizes_and_tokens_are_refused() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    for path in ["/v1/pools", "/v1/hosts", "/v1/vms"] {
        for q in [
            "page_size=0",
            "page_size=1001",
            "page_size=-1",
            "page_size=x",
            "page_token=%%%",
            "page_token=AA",
            "page_token=!",
        ] {
            let r = app.get(ADMIN, &format!("{path}?{q}")).await;
            r.assert_error(400, "INVALID_ARGUMENT");
            assert!(r.body["error"]["message"].as_str().unwrap().contains("page_"), "{path}?{q}: {}", r.body);
        }
        app.get(ADMIN, &format!("{path}?page_size=1000")).await.assert_ok(200);
    }
    // A token that decodes to no pool key (no `/`) is not a pools token.
    use base64::Engine;
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("no-slash");
    app.get(ADMIN, &format!("/v1/pools?page_token={token}")).await.assert_error(400, "INVALID_ARGUMENT");
}

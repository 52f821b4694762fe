//! `infra/template.yaml` as a first deploy into a new account meets it: the properties
//! `cfn-lint` cannot judge (it checks the template is valid, not that it does what we need),
//! read off the YAML with a small evaluator of the few intrinsics they use.

use std::collections::{BTreeMap, BTreeSet};

use poolmgr_core::config::Config;
use poolmgr_core::db::SslMode;
use yaml_serde::Value;

fn template() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../infra/template.yaml")).unwrap();
    yaml_serde::from_str(&text).expect("infra/template.yaml is YAML")
}

fn resource<'a>(t: &'a Value, name: &str) -> &'a Value {
    let r = &t["Resources"][name];
    assert!(!r.is_null(), "no resource {name} in infra/template.yaml");
    r
}

/// `!Tag value` → (tag without `!`, value).
fn tagged(v: &Value) -> Option<(String, &Value)> {
    match v {
        Value::Tagged(t) => Some((t.tag.to_string().trim_start_matches('!').to_owned(), &t.value)),
        _ => None,
    }
}

fn is_ref(v: &Value, name: &str) -> bool {
    tagged(v).is_some_and(|(tag, value)| tag == "Ref" && value.as_str() == Some(name))
}

fn sub_text(v: &Value) -> Option<&str> {
    tagged(v).and_then(|(tag, value)| (tag == "Sub").then(|| value.as_str()).flatten())
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("expected a string, got {v:?}"))
}

/// Evaluates a property under `params` (name → value, as CloudFormation passes them: strings).
/// `None` is `AWS::NoValue`, i.e. the property is left out.
fn eval(t: &Value, v: &Value, params: &BTreeMap<String, String>) -> Option<Value> {
    let Some((tag, inner)) = tagged(v) else { return Some(v.clone()) };
    match tag.as_str() {
        "Ref" => {
            let name = str_of(inner);
            if name == "AWS::NoValue" {
                return None;
            }
            Some(Value::String(params.get(name).unwrap_or_else(|| panic!("no parameter {name}")).clone()))
        }
        "If" => {
            let args = inner.as_sequence().expect("!If [condition, then, else]");
            let cond = str_of(&args[0]);
            if condition(t, &t["Conditions"][cond], params) {
                eval(t, &args[1], params)
            } else {
                eval(t, &args[2], params)
            }
        }
        other => panic!("the evaluator does not know !{other}"),
    }
}

fn condition(t: &Value, c: &Value, params: &BTreeMap<String, String>) -> bool {
    let (tag, inner) = tagged(c).unwrap_or_else(|| panic!("a condition is an intrinsic: {c:?}"));
    let args = inner.as_sequence();
    match tag.as_str() {
        "Not" => !condition(t, &args.unwrap()[0], params),
        "Equals" => {
            let a = args.unwrap();
            let side = |v: &Value| match eval(t, v, params) {
                Some(Value::String(s)) => s,
                Some(Value::Number(n)) => n.to_string(),
                other => panic!("cannot compare {other:?}"),
            };
            side(&a[0]) == side(&a[1])
        }
        "Condition" => condition(t, &t["Conditions"][str_of(inner)], params),
        other => panic!("the evaluator does not know condition !{other}"),
    }
}

/// Every parameter at its default (`""` when it has none).
fn defaults(t: &Value) -> BTreeMap<String, String> {
    t["Parameters"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, p)| {
            let d = match &p["Default"] {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                _ => String::new(),
            };
            (str_of(k).to_owned(), d)
        })
        .collect()
}

fn functions(t: &Value) -> Vec<(String, &Value)> {
    t["Resources"]
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(_, r)| r["Type"].as_str() == Some("AWS::Serverless::Function"))
        .map(|(k, r)| (str_of(k).to_owned(), r))
        .collect()
}

#[test]
fn rds_proxy_can_reach_the_secrets_manager_endpoint_without_a_nat_gateway() {
    let t = template();
    let endpoint = resource(&t, "SecretsManagerEndpoint");
    let sgs = endpoint["Properties"]["SecurityGroupIds"].as_sequence().unwrap();
    assert!(sgs.iter().any(|v| is_ref(v, "EndpointSecurityGroup")), "{sgs:?}");
    let ingress = resource(&t, "EndpointSecurityGroup")["Properties"]["SecurityGroupIngress"].as_sequence().unwrap();
    for source in ["FunctionSecurityGroup", "ProxySecurityGroup"] {
        assert!(
            ingress.iter().any(|r| is_ref(&r["SourceSecurityGroupId"], source)
                && r["IpProtocol"].as_str() == Some("tcp")
                && r["FromPort"].as_u64().is_some_and(|p| p <= 443)
                && r["ToPort"].as_u64().is_some_and(|p| p >= 443)),
            "the endpoint must let {source} in on 443: {ingress:?}"
        );
    }
    // The proxy's own group keeps the default egress (everything), so 443 leaves it.
    assert!(resource(&t, "ProxySecurityGroup")["Properties"]["SecurityGroupEgress"].is_null());
}

#[test]
fn only_the_reconcile_function_reserves_concurrency_by_default_a_loop_and_a_spare() {
    let t = template();
    let params = defaults(&t);
    let fns = functions(&t);
    assert!(fns.len() >= 7, "{:?}", fns.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let mut governed = 0;
    for (name, f) in &fns {
        let prop = &f["Properties"]["ReservedConcurrentExecutions"];
        if prop.is_null() {
            continue;
        }
        // Reserved only through a parameter, never a literal a new account cannot afford.
        let (tag, args) = tagged(prop).unwrap_or_else(|| panic!("{name} reserves a fixed {prop:?}"));
        assert_eq!(tag, "If", "{name}");
        let param = tagged(&args[1]).map(|(_, v)| str_of(v).to_owned()).expect("the reserved value is a parameter");
        if name == "ReconcileFunction" {
            // A flood of API calls cannot take the reconciler's concurrency. One loop runs at
            // a time (the loop lease); the spare takes a tick or hand-off meanwhile, which
            // asks the loop to go on, instead of a throttle and Lambda's retries.
            assert_eq!(eval(&t, prop, &params), Some(Value::String("2".into())), "{name}");
        } else {
            assert_eq!(eval(&t, prop, &params), None, "{name} must be unreserved with the defaults");
            assert_eq!(params[&param], "0", "{param} defaults to 0");
        }
        // 0 leaves any of them unreserved (an account whose limit is 100 or less)…
        let mut zero = params.clone();
        zero.insert(param.clone(), "0".into());
        assert_eq!(eval(&t, prop, &zero), None, "{name} with {param}=0");
        // …and another number reserves that.
        let mut five = params.clone();
        five.insert(param.clone(), "5".into());
        assert_eq!(eval(&t, prop, &five), Some(Value::String("5".into())), "{name} with {param}=5");
        governed += 1;
    }
    assert_eq!(governed, 6, "the six concurrency parameters each govern their function");
}

/// `{route key: (rate, burst)}` of every HttpApi event, with the stage's default where the
/// event sets none, evaluated under `params`.
fn route_throttles(t: &Value, params: &BTreeMap<String, String>) -> BTreeMap<String, (f64, f64)> {
    let num = |v: &Value| -> f64 {
        match eval(t, v, params) {
            Some(Value::String(s)) => s.parse().unwrap_or_else(|_| panic!("{s:?} is not a number")),
            Some(Value::Number(n)) => n.as_f64().unwrap(),
            other => panic!("a throttle must be set, got {other:?}"),
        }
    };
    let api = &resource(t, "HttpApi")["Properties"]["DefaultRouteSettings"];
    assert!(!api.is_null(), "the HTTP API has no DefaultRouteSettings: its routes are not throttled");
    let default = (num(&api["ThrottlingRateLimit"]), num(&api["ThrottlingBurstLimit"]));
    let mut out = BTreeMap::new();
    for (fname, f) in functions(t) {
        let Some(events) = f["Properties"]["Events"].as_mapping() else { continue };
        for (ename, e) in events {
            if e["Type"].as_str() != Some("HttpApi") {
                continue;
            }
            let p = &e["Properties"];
            let (Some(m), Some(path)) = (p["Method"].as_str(), p["Path"].as_str()) else {
                panic!("{fname}.{ename:?} is a $default route: an unmatched path would invoke a function")
            };
            let rs = &p["RouteSettings"];
            let throttle = if rs.is_null() {
                default
            } else {
                (num(&rs["ThrottlingRateLimit"]), num(&rs["ThrottlingBurstLimit"]))
            };
            out.insert(format!("{m} {path}"), throttle);
        }
    }
    out
}

#[test]
fn every_route_is_throttled_the_open_ones_hardest_and_no_catch_all_route_invokes_a_function() {
    let t = template();
    let params = defaults(&t);
    let routes = route_throttles(&t, &params);
    assert!(routes.len() > 30, "{routes:?}");
    for (route, (rate, burst)) in &routes {
        assert!(*rate >= 1.0 && *burst >= *rate, "{route}: rate {rate}, burst {burst}");
    }
    let of = |k: &str| *routes.get(k).unwrap_or_else(|| panic!("no route {k}"));
    let admin = of("POST /v1/pools");
    let client = of("POST /v1/claims");
    for probe in ["GET /livez", "GET /readyz", "GET /healthz", "GET /openapi.json"] {
        let (rate, burst) = of(probe);
        assert!(rate < admin.0 && burst < admin.1, "{probe} needs no token: it gets the lowest limit");
    }
    for route in [
        "GET /v1/leases",
        "GET /v1/leases/{lease_id}",
        "DELETE /v1/leases/{lease_id}",
        "POST /v1/leases/{lease_id}/heartbeat",
    ] {
        assert_eq!(of(route), client, "{route} is a client route");
    }
    assert!(client.0 > admin.0, "claims and heartbeats carry the traffic: {client:?} vs {admin:?}");
    assert_eq!(of("GET /v1/events"), admin);
    // The parameters move them.
    let mut tight = params.clone();
    tight.insert("ApiThrottleRate".into(), "3".into());
    tight.insert("ClientThrottleBurst".into(), "7".into());
    let tight = route_throttles(&t, &tight);
    assert_eq!(tight["PUT /v1/hosts/{name}"].0, 3.0);
    assert_eq!(tight["POST /v1/claims"].1, 7.0);
}

#[test]
fn each_stack_writes_its_metrics_to_its_own_namespace_and_its_empty_pool_alarm_reads_that_one() {
    let t = template();
    let env = &t["Globals"]["Function"]["Environment"]["Variables"];
    let ns = sub_text(&env["POOLMGR_METRICS_NAMESPACE"]).expect("POOLMGR_METRICS_NAMESPACE is a !Sub");
    assert!(ns.contains("${AWS::StackName}"), "{ns}");
    let metrics = resource(&t, "PoolEmptyAlarm")["Properties"]["Metrics"].as_sequence().unwrap();
    let query = metrics.iter().find_map(|m| sub_text(&m["Expression"])).expect("the alarm's query is a !Sub");
    assert!(query.contains(&format!("SCHEMA(\"{ns}\"")), "{query} must read namespace {ns}");
}

#[test]
fn the_functions_security_group_is_exported_under_the_stack_name() {
    let t = template();
    let outputs = t["Outputs"].as_mapping().unwrap();
    let out = outputs
        .values()
        .find(|o| {
            tagged(&o["Value"])
                .is_some_and(|(tag, v)| tag == "GetAtt" && v.as_str() == Some("FunctionSecurityGroup.GroupId"))
        })
        .expect("an output with the functions' security group id");
    let export = sub_text(&out["Export"]["Name"]).expect("an export named with !Sub");
    assert!(export.contains("${AWS::StackName}"), "{export}");
}

#[test]
fn the_api_access_log_is_json_with_the_lambda_request_id_to_join_function_logs() {
    let t = template();
    let format = str_of(&resource(&t, "HttpApi")["Properties"]["AccessLogSettings"]["Format"]);
    let line: serde_json::Value = serde_json::from_str(format).expect("the access log format is one JSON object");
    assert_eq!(line["integrationRequestId"], "$context.integration.requestId");
    assert_eq!(line["requestId"], "$context.requestId");
}

#[test]
fn the_database_and_the_proxy_have_health_alarms_that_notify_the_topic() {
    let t = template();
    let alarms: Vec<&Value> = t["Resources"]
        .as_mapping()
        .unwrap()
        .values()
        .filter(|r| r["Type"].as_str() == Some("AWS::CloudWatch::Alarm"))
        .map(|r| &r["Properties"])
        .collect();
    // (metric, dimension, resource it must name)
    for (metric, dim, target) in [
        ("CPUUtilization", "DBInstanceIdentifier", "Database"),
        ("FreeStorageSpace", "DBInstanceIdentifier", "Database"),
        ("DatabaseConnectionsCurrentlyBorrowed", "ProxyName", "DatabaseProxy"),
    ] {
        let on_metric = |a: &&&Value| {
            let direct = a["MetricName"].as_str() == Some(metric) && dims_name(&a["Dimensions"], dim, target);
            let math = a["Metrics"].as_sequence().is_some_and(|ms| {
                ms.iter().any(|m| {
                    let m = &m["MetricStat"]["Metric"];
                    m["MetricName"].as_str() == Some(metric) && dims_name(&m["Dimensions"], dim, target)
                })
            });
            direct || math
        };
        let alarm = alarms.iter().find(on_metric).unwrap_or_else(|| panic!("no alarm on {metric} of {target}"));
        let actions = alarm["AlarmActions"].as_sequence().unwrap();
        assert!(actions.iter().any(|a| is_ref(a, "AlarmTopic")), "{metric}: {actions:?}");
    }
}

fn dims_name(dims: &Value, name: &str, target: &str) -> bool {
    dims.as_sequence()
        .is_some_and(|ds| ds.iter().any(|d| d["Name"].as_str() == Some(name) && is_ref(&d["Value"], target)))
}

#[test]
fn the_proxy_requires_tls_and_the_functions_accept_the_settings_the_template_gives_them() {
    let t = template();
    assert_eq!(resource(&t, "DatabaseProxy")["Properties"]["RequireTLS"], Value::Bool(true));
    // The functions' configuration, read from the template's environment (stack "stack-a"),
    // is accepted and means what the template says.
    let env = &t["Globals"]["Function"]["Environment"]["Variables"];
    let mut vars: BTreeMap<String, String> = env
        .as_mapping()
        .unwrap()
        .iter()
        .filter_map(|(k, v)| {
            let v = match v {
                Value::String(s) => s.clone(),
                _ => sub_text(v)?.replace("${AWS::StackName}", "stack-a"),
            };
            Some((str_of(k).to_owned(), v))
        })
        .collect();
    vars.insert("DATABASE_URL".into(), "postgres://u:p@proxy.example/poolmgr".into());
    vars.insert("POOLMGR_ADMIN_TOKENS".into(), "admin:0123456789abcdef".into());
    vars.insert("AWS_LAMBDA_FUNCTION_NAME".into(), "claims".into());
    let cfg =
        Config::from_lookup(|k| vars.get(k).cloned()).expect("the template's environment is a valid configuration");
    assert_eq!(cfg.db_tls.default_mode(), Some(SslMode::VerifyFull));
    assert_eq!(cfg.metrics_namespace, "poolmgr/stack-a");
}

/// The role a function runs as (`Role: !GetAtt <role>.Arn`).
fn role_of<'a>(t: &'a Value, function: &str) -> (String, &'a Value) {
    let role = &resource(t, function)["Properties"]["Role"];
    let (tag, v) = tagged(role).unwrap_or_else(|| panic!("{function}'s Role is not a !GetAtt: {role:?}"));
    assert_eq!(tag, "GetAtt", "{function}");
    let name = str_of(v).strip_suffix(".Arn").expect("!GetAtt <role>.Arn").to_owned();
    let r = resource(t, &name);
    (name, r)
}

/// Issue 25 item 9: every function's role grants what that function uses and nothing more
/// (beyond running in the VPC and writing logs).
#[test]
fn each_function_runs_as_a_role_that_grants_only_what_it_uses() {
    let t = template();
    const SECRET: &str = "secretsmanager:GetSecretValue";
    const INVOKE: &str = "lambda:InvokeFunction";
    const DLQ: &str = "sqs:SendMessage";
    let both = ["AppDatabaseSecret", "TokensSecret"];
    // Those that seal or open hosts' secrets also read the credentials key (issue 25 item 4).
    let three = ["AppDatabaseSecret", "TokensSecret", "CredentialsKeySecret"];
    let expected: [(&str, &[&str], &[&str]); 7] = [
        ("MigrateFunction", &["DatabaseSecret", "AppDatabaseSecret"], &[SECRET]),
        ("ClaimsFunction", &three, &[SECRET, INVOKE]),
        ("LeasesFunction", &three, &[SECRET, INVOKE]),
        ("PoolsFunction", &three, &[SECRET, INVOKE]),
        ("HostsFunction", &three, &[SECRET]),
        ("EventsFunction", &both, &[SECRET]),
        ("ReconcileFunction", &three, &[SECRET, INVOKE, DLQ]),
    ];
    for (function, secrets, actions) in expected {
        let (name, role) = role_of(&t, function);
        let managed: Vec<String> = role["Properties"]["ManagedPolicyArns"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| sub_text(v).unwrap_or_else(|| str_of(v)).to_owned())
            .collect();
        assert_eq!(managed.len(), 1, "{name}: {managed:?}");
        assert!(managed[0].ends_with("service-role/AWSLambdaVPCAccessExecutionRole"), "{name}: {managed:?}");
        let mut got_actions = BTreeSet::new();
        let mut got_secrets = BTreeSet::new();
        for policy in role["Properties"]["Policies"].as_sequence().unwrap() {
            for st in policy["PolicyDocument"]["Statement"].as_sequence().unwrap() {
                assert_eq!(st["Effect"].as_str(), Some("Allow"), "{name}");
                let action = str_of(&st["Action"]);
                assert!(!action.contains('*'), "{name} grants a wildcard action {action}");
                got_actions.insert(action.to_owned());
                let resources = match &st["Resource"] {
                    Value::Sequence(s) => s.iter().collect::<Vec<_>>(),
                    one => vec![one],
                };
                for r in resources {
                    assert!(r.as_str() != Some("*"), "{name}: {action} on every resource");
                    if action == SECRET {
                        let (tag, v) = tagged(r).expect("a secret by !Ref");
                        assert_eq!(tag, "Ref", "{name}");
                        got_secrets.insert(str_of(v).to_owned());
                    }
                    if action == INVOKE {
                        let arn = sub_text(r).expect("the reconcile function's ARN");
                        assert!(arn.ends_with(":function:${AWS::StackName}-reconcile"), "{name} may invoke {arn}");
                    }
                }
            }
        }
        let want: BTreeSet<String> = actions.iter().map(|s| s.to_string()).collect();
        assert_eq!(got_actions, want, "{function} runs as {name}");
        let want: BTreeSet<String> = secrets.iter().map(|s| s.to_string()).collect();
        assert_eq!(got_secrets, want, "{function} runs as {name}");
    }
    // The migrate function is not even told where the tokens secret or the credentials key
    // is, nor the events function where the key is.
    let env = &resource(&t, "MigrateFunction")["Properties"]["Environment"]["Variables"];
    assert_eq!(env["POOLMGR_TOKENS_SECRET_ARN"].as_str(), Some(""));
    assert_eq!(env["POOLMGR_CREDENTIALS_SECRET_ARN"].as_str(), Some(""));
    let env = &resource(&t, "EventsFunction")["Properties"]["Environment"]["Variables"];
    assert_eq!(env["POOLMGR_CREDENTIALS_SECRET_ARN"].as_str(), Some(""));
    // Every other function is: the Globals name the generated secret.
    let globals = &t["Globals"]["Function"]["Environment"]["Variables"]["POOLMGR_CREDENTIALS_SECRET_ARN"];
    assert!(is_ref(globals, "CredentialsKeySecret"), "{globals:?}");
    let generated = &resource(&t, "CredentialsKeySecret")["Properties"]["GenerateSecretString"];
    assert_eq!(str_of(&generated["GenerateStringKey"]), "credentials_key");
    assert!(generated["PasswordLength"].as_u64().unwrap() >= 32);
}

/// Issue 25 item 9: the functions log in as the runtime role (the generated
/// `AppDatabaseSecret`, not the master's), migrate as the master with the runtime login to
/// grant, and RDS Proxy accepts both logins.
#[test]
fn only_migrate_logs_in_as_the_master_and_the_proxy_knows_both_logins() {
    let t = template();
    let globals = &t["Globals"]["Function"]["Environment"]["Variables"];
    assert!(is_ref(&globals["POOLMGR_DATABASE_SECRET_ARN"], "AppDatabaseSecret"), "{globals:?}");
    let migrate = &resource(&t, "MigrateFunction")["Properties"]["Environment"]["Variables"];
    assert!(is_ref(&migrate["POOLMGR_DATABASE_SECRET_ARN"], "DatabaseSecret"), "{migrate:?}");
    assert!(is_ref(&migrate["POOLMGR_RUNTIME_DATABASE_SECRET_ARN"], "AppDatabaseSecret"), "{migrate:?}");
    for (name, r) in t["Resources"].as_mapping().unwrap() {
        if r["Type"].as_str() != Some("AWS::Serverless::Function") || str_of(name) == "MigrateFunction" {
            continue;
        }
        let env = &r["Properties"]["Environment"]["Variables"];
        for var in ["POOLMGR_DATABASE_SECRET_ARN", "POOLMGR_RUNTIME_DATABASE_SECRET_ARN", "DATABASE_URL"] {
            assert!(env[var].is_null(), "{} overrides {var}: {env:?}", str_of(name));
        }
    }
    let user_of = |secret: &str| -> String {
        let tpl = str_of(&resource(&t, secret)["Properties"]["GenerateSecretString"]["SecretStringTemplate"]);
        let v: serde_json::Value = serde_json::from_str(tpl).unwrap();
        v["username"].as_str().unwrap().to_owned()
    };
    assert_ne!(user_of("AppDatabaseSecret"), user_of("DatabaseSecret"));
    poolmgr_core::db_role::from_lookup(|k| match k {
        poolmgr_core::db_role::USER => Some(user_of("AppDatabaseSecret")),
        _ => Some("x".repeat(32)),
    })
    .expect("a role name the migrate function accepts");
    let auth: BTreeSet<String> = resource(&t, "DatabaseProxy")["Properties"]["Auth"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| {
            assert_eq!(a["ClientPasswordAuthType"].as_str(), Some("POSTGRES_SCRAM_SHA_256"), "{a:?}");
            let (tag, v) = tagged(&a["SecretArn"]).unwrap();
            assert_eq!(tag, "Ref");
            str_of(v).to_owned()
        })
        .collect();
    let both: BTreeSet<String> = ["DatabaseSecret".into(), "AppDatabaseSecret".into()].into();
    assert_eq!(auth, both);
    let proxy_reads: BTreeSet<String> =
        resource(&t, "DatabaseProxyRole")["Properties"]["Policies"][0]["PolicyDocument"]["Statement"][0]["Resource"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|r| str_of(tagged(r).unwrap().1).to_owned())
            .collect();
    assert_eq!(proxy_reads, both);
}

/// Issue 25 item 9: the functions' security group opens connections only to RDS Proxy
/// (5432, to the proxy's group), the flintlock port (to the hosts' CIDR) and HTTPS (AWS APIs
/// through endpoints or a NAT gateway): no all-protocol, all-port rule.
#[test]
fn the_functions_may_connect_only_to_the_proxy_the_flintlock_port_and_https() {
    let t = template();
    let params = defaults(&t);
    let port = |v: &Value| -> String {
        match eval(&t, v, &params) {
            Some(Value::String(s)) => s,
            Some(Value::Number(n)) => n.to_string(),
            other => panic!("a port, got {other:?}"),
        }
    };
    let mut rules = BTreeSet::new();
    for r in resource(&t, "FunctionSecurityGroup")["Properties"]["SecurityGroupEgress"].as_sequence().unwrap() {
        assert_eq!(r["IpProtocol"].as_str(), Some("tcp"), "{r:?}");
        let (from, to) = (port(&r["FromPort"]), port(&r["ToPort"]));
        assert_eq!(from, to, "one port per rule: {r:?}");
        let cidr = match eval(&t, &r["CidrIp"], &params) {
            Some(Value::String(s)) => s,
            other => panic!("{other:?}"),
        };
        rules.insert((
            from,
            if is_ref(&r["CidrIp"], "FlintlockHostsCidr") { "FlintlockHostsCidr".into() } else { cidr },
        ));
    }
    let want: BTreeSet<(String, String)> =
        [("9090".into(), "FlintlockHostsCidr".into()), ("443".into(), "0.0.0.0/0".into())].into();
    assert_eq!(rules, want);
    // And 5432 to the proxy's group only, as a rule of its own.
    let separate: Vec<&Value> = t["Resources"]
        .as_mapping()
        .unwrap()
        .values()
        .filter(|r| r["Type"].as_str() == Some("AWS::EC2::SecurityGroupEgress"))
        .collect();
    assert_eq!(separate.len(), 1, "{separate:?}");
    let p = &separate[0]["Properties"];
    assert_eq!(tagged(&p["GroupId"]).map(|(_, v)| str_of(v).to_owned()), Some("FunctionSecurityGroup.GroupId".into()));
    assert_eq!(
        tagged(&p["DestinationSecurityGroupId"]).map(|(_, v)| str_of(v).to_owned()),
        Some("ProxySecurityGroup.GroupId".into())
    );
    assert_eq!((port(&p["FromPort"]), port(&p["ToPort"])), ("5432".into(), "5432".into()));
    assert!(p["CidrIp"].is_null());
}

/// Where a dashboard query or metric may point: an alarm's metric (namespace, name, and its
/// dimensions as `name=resource`), read off every alarm of the template.
fn alarm_metrics(t: &Value) -> BTreeSet<(String, String, BTreeSet<String>)> {
    let dims = |m: &Value| -> BTreeSet<String> {
        m["Dimensions"]
            .as_sequence()
            .map(|ds| {
                ds.iter()
                    .map(|d| {
                        let target = match tagged(&d["Value"]) {
                            Some((tag, v)) if tag == "Ref" => str_of(v).to_owned(),
                            // `X.Attr`: the resource is what the dashboard names too.
                            Some((tag, v)) if tag == "GetAtt" => str_of(v).split('.').next().unwrap().to_owned(),
                            other => panic!("a dimension names a resource: {other:?}"),
                        };
                        format!("{}={target}", str_of(&d["Name"]))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = BTreeSet::new();
    for r in t["Resources"].as_mapping().unwrap().values() {
        if r["Type"].as_str() != Some("AWS::CloudWatch::Alarm") {
            continue;
        }
        let p = &r["Properties"];
        if let Some(name) = p["MetricName"].as_str() {
            out.insert((str_of(&p["Namespace"]).to_owned(), name.to_owned(), dims(p)));
        }
        for m in p["Metrics"].as_sequence().into_iter().flatten() {
            let m = &m["MetricStat"]["Metric"];
            if let Some(name) = m["MetricName"].as_str() {
                out.insert((str_of(&m["Namespace"]).to_owned(), name.to_owned(), dims(m)));
            }
        }
    }
    out
}

/// Issue 26 item 7: the stack has a CloudWatch dashboard showing every alarm, over metrics the
/// alarms read (the same namespace, name and dimensions) or the functions write as EMF (this
/// stack's namespace, the dimension set each is written with; pool gauges read with MAX,
/// counters with SUM), covering demand sizing and rollouts.
#[test]
fn the_dashboard_shows_every_alarm_and_names_only_metrics_the_alarms_read_or_the_functions_write() {
    let t = template();
    let d = resource(&t, "Dashboard");
    assert_eq!(d["Type"].as_str(), Some("AWS::CloudWatch::Dashboard"));
    let name = sub_text(&d["Properties"]["DashboardName"]).expect("DashboardName is a !Sub");
    assert!(name.contains("${AWS::StackName}"), "one dashboard per stack: {name}");
    let body = sub_text(&d["Properties"]["DashboardBody"]).expect("DashboardBody is a !Sub");

    // ${AWS::StackName} → stack, ${AWS::Region} → region, ${X} → X, ${X.Attr} → X (each X a
    // resource of the template).
    let var = regex::Regex::new(r"\$\{([A-Za-z0-9:]+)(?:\.[A-Za-z]+)?\}").unwrap();
    let body = var.replace_all(body, |c: &regex::Captures| match &c[1] {
        "AWS::StackName" => "stack".to_owned(),
        "AWS::Region" => "region".to_owned(),
        r => {
            assert!(!t["Resources"][r].is_null(), "the dashboard names {r}, which is no resource");
            r.to_owned()
        }
    });
    let body: serde_json::Value = serde_json::from_str(&body).expect("the dashboard body is JSON");
    let widgets = body["widgets"].as_array().expect("widgets");

    // Every alarm of the template, and nothing else, in the alarm widget.
    let alarms: BTreeSet<String> = t["Resources"]
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(_, r)| r["Type"].as_str() == Some("AWS::CloudWatch::Alarm"))
        .map(|(k, _)| str_of(k).to_owned())
        .collect();
    let shown: BTreeSet<String> = widgets
        .iter()
        .filter(|w| w["type"] == "alarm")
        .flat_map(|w| w["properties"]["alarms"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(shown, alarms, "the alarm widget lists every alarm of the template");

    let from_alarms = alarm_metrics(&t);
    let emf_namespace = sub_text(&t["Globals"]["Function"]["Environment"]["Variables"]["POOLMGR_METRICS_NAMESPACE"])
        .unwrap()
        .replace("${AWS::StackName}", "stack");
    // What the functions write: every family of a process and the pool gauges, with its labels
    // as the EMF dimensions.
    let metrics = poolmgr_core::metrics::Metrics::new();
    let mut written: BTreeMap<String, (&str, BTreeSet<String>)> =
        metrics.families().iter().map(|f| (f.name.clone(), (f.kind, f.labels.iter().cloned().collect()))).collect();
    for (g, _, _) in poolmgr_core::metrics::POOL_GAUGES {
        let labels = poolmgr_core::metrics::POOL_LABELS.iter().map(|l| l.to_string()).collect();
        written.insert(g.to_owned(), ("gauge", labels));
    }
    let query = regex::Regex::new(
        r#"^SELECT (MAX|SUM)\((\w+)\) FROM SCHEMA\("([^"]+)"((?:, \w+)*)\)(?: GROUP BY \w+(?:, \w+)*)?$"#,
    )
    .unwrap();

    let mut read = BTreeSet::new();
    let mut metric_widgets = 0;
    for w in widgets.iter().filter(|w| w["type"] == "metric") {
        metric_widgets += 1;
        let title = w["properties"]["title"].as_str().unwrap_or("?");
        for m in w["properties"]["metrics"].as_array().expect("metrics") {
            let m = m.as_array().expect("a metric is an array");
            if let Some(expr) = m[0]["expression"].as_str() {
                let c = query.captures(expr).unwrap_or_else(|| panic!("{title}: not a query this test reads: {expr}"));
                let (stat, metric, ns) = (&c[1], &c[2], &c[3]);
                assert_eq!(ns, emf_namespace, "{title}: {expr}");
                let (kind, labels) =
                    written.get(metric).unwrap_or_else(|| panic!("{title}: the functions never write {metric}"));
                let dims: BTreeSet<String> =
                    c[4].split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
                assert_eq!(&dims, labels, "{title}: {metric} is written with the dimensions {labels:?}");
                let want = if *kind == "counter" { "SUM" } else { "MAX" };
                assert_eq!(stat, want, "{title}: a {kind} is read with {want}");
                read.insert(metric.to_owned());
            } else {
                let strings: Vec<&str> = m.iter().filter_map(|v| v.as_str()).collect();
                let (ns, name) = (strings[0], strings[1]);
                let dims: BTreeSet<String> = strings[2..].chunks(2).map(|kv| format!("{}={}", kv[0], kv[1])).collect();
                let key = (ns.to_owned(), name.to_owned(), dims);
                assert!(from_alarms.contains(&key), "{title}: {key:?} is no alarm's metric");
                read.insert(name.to_owned());
            }
        }
    }
    assert!(metric_widgets >= 12, "{metric_widgets} metric widgets");
    for must in [
        "poolmgr_pool_available",
        "poolmgr_pool_desired_size",
        "poolmgr_pool_claims_per_second",
        "poolmgr_pool_refused_claims_per_second",
        "poolmgr_pool_rollout_halted",
        "poolmgr_pool_stale_vms",
        "poolmgr_vm_claims_total",
        "poolmgr_flintlock_errors_total",
        "Errors",
        "5xx",
        "CPUUtilization",
    ] {
        assert!(read.contains(must), "the dashboard never shows {must}: {read:?}");
    }
}

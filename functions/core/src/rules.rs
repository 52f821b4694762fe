//! The rules a request value must follow, each written once: the constant or pattern the
//! validators check, and the schema-only types that state it in the OpenAPI document
//! (`/openapi.json`), so that the document and the service cannot disagree.
//!
//! A schema-only type is never constructed: a field names it (`#[schema(value_type = PoolSize)]`)
//! and its `PartialSchema` builds the schema from the same constant or [`Pattern`] that the
//! validator checks. Shared rules are components (`$ref`), so each is stated in one place of
//! the document too; rules that tie fields of one object together (a oneOf, an anyOf) are
//! written next to their object (`template.rs`, `domain/`, `service/host.rs`).
//!
//! Lengths are counted in characters, as JSON Schema's `maxLength` counts them, except the
//! contract's 255-*byte* `request_id`: its schema states the 255 characters an ASCII id may
//! have, and its description the byte limit (the one rule here that JSON Schema cannot state).
//! Patterns are written in the common subset of ECMA-262 (what JSON Schema tools use) and the
//! `regex` crate, with explicit character classes instead of `\s`, whose two definitions differ.
//!
//! Rules that compare two fields (`min_size` ≤ `size`, unique volume ids, …) or a field with
//! the database (a registered host) cannot be stated by a schema: their objects' descriptions
//! say them. Nothing here does I/O.

use std::sync::OnceLock;

use regex::Regex;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::{Ref, RefOr};

/// Longest accepted `request_id`, in bytes (not characters): the contract's limit.
pub const MAX_REQUEST_ID_BYTES: usize = 255;
pub const MAX_POOL_SIZE: i32 = 10_000;
/// Longest accepted hook command (characters) and number of commands, so a pool row stays small.
pub const MAX_COMMAND_CHARS: usize = 4096;
pub const MAX_COMMANDS: usize = 64;
/// flintlock's own limits for a microVM (its CreateMicroVM validation).
pub const VCPU: (i32, i32) = (1, 64);
pub const MEMORY_IN_MB: (i32, i32) = (1024, 32768);
pub const DEFAULT_VCPU: i32 = 2;
pub const DEFAULT_MEMORY_IN_MB: i32 = 1024;
/// The microVM providers flintlock knows, and the one used when none is given (which supports
/// neither MACVTAP nor virtiofs).
pub const PROVIDERS: [&str; 2] = ["firecracker", "cloudhypervisor"];
pub const DEFAULT_PROVIDER: &str = PROVIDERS[0];
/// Longest host address (`host:port`, ASCII).
pub const MAX_HOST_ADDRESS_CHARS: usize = 255;
/// Largest PEM block of a host's TLS settings.
pub const MAX_PEM_CHARS: usize = 16 * 1024;
pub const MAX_BASIC_AUTH_TOKEN_CHARS: usize = 1024;
pub const MAX_CORDON_REASON_CHARS: usize = 1024;
/// Longest lease id accepted in a path (ours are 36-character UUIDs).
pub const MAX_LEASE_ID_CHARS: usize = 64;
/// The longest key a page ends at: a lease id, a VM id, a host name, or a pool's
/// `namespace/name` (63 + 1 + 63).
pub const MAX_PAGE_KEY_CHARS: usize = 128;
/// A page token is the unpadded base64url of a page's last key: at most this long.
pub const MAX_PAGE_TOKEN_CHARS: usize = (MAX_PAGE_KEY_CHARS * 4).div_ceil(3);
pub const DEFAULT_PAGE_SIZE: i64 = 100;
pub const MAX_PAGE_SIZE: i64 = 1000;
pub const DEFAULT_EVENTS_LIMIT: i64 = 100;
pub const MAX_EVENTS_LIMIT: i64 = 1000;
/// Longest long-poll on the events feed.
pub const MAX_EVENTS_WAIT_SECONDS: u64 = 20;

/// A regular expression written once, for the validator ([`Pattern::is_match`]) and for the
/// document ([`Pattern::as_str`]). Built on first use.
pub struct Pattern {
    build: fn() -> String,
    compiled: OnceLock<(String, Regex)>,
}

impl Pattern {
    const fn new(build: fn() -> String) -> Pattern {
        Pattern { build, compiled: OnceLock::new() }
    }

    fn get(&self) -> &(String, Regex) {
        self.compiled.get_or_init(|| {
            let source = (self.build)();
            let re = Regex::new(&source).expect("static regex");
            (source, re)
        })
    }

    pub fn as_str(&self) -> &str {
        &self.get().0
    }

    pub fn is_match(&self, s: &str) -> bool {
        self.get().1.is_match(s)
    }
}

/// Unicode White_Space, which Rust's `char::is_whitespace` and `str::trim` use, spelled out
/// (ECMA-262's `\s` differs: it has U+FEFF and lacks U+0085).
const SPACE: &str = r"\t\n\x0B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000";

/// Text with at least one character that is not white space (what `trim()` leaves non-empty).
pub static NOT_BLANK: Pattern = Pattern::new(|| format!("[^{SPACE}]"));

/// A network interface's `device_id`, as flintlock requires it.
pub static DEVICE_ID: Pattern = Pattern::new(|| r"^[a-z][a-z0-9_]*$".into());

/// A MAC address `aa:bb:cc:dd:ee:ff`, or empty (flintlock then picks one).
pub static GUEST_MAC: Pattern = Pattern::new(|| r"^(([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2})?$".into());

const IPV4_OCTET: &str = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";

/// An IPv4 address as Rust's `Ipv4Addr` parses it: four decimal octets, no leading zeros.
fn ipv4() -> String {
    format!(r"{IPV4_OCTET}(\.{IPV4_OCTET}){{3}}")
}

/// An IPv6 address as Rust's `Ipv6Addr` parses it: eight groups of 1-4 hex digits, or fewer
/// around one `::` that stands for at least one group, the last two groups optionally written
/// as an IPv4 address. No zone, no brackets.
fn ipv6() -> String {
    const H: &str = "[0-9A-Fa-f]{1,4}";
    let v4 = ipv4();
    // `a` groups before the `::`, `b` after it: a + b <= 7.
    let left = |a: usize| match a {
        0 => String::new(),
        1 => H.to_owned(),
        _ => format!("{H}(:{H}){{{}}}", a - 1),
    };
    let mut alts = vec![format!("({H}:){{7}}{H}"), format!("({H}:){{6}}{v4}")];
    for a in 0..=7 {
        let right = if a == 7 { String::new() } else { format!("({H}(:{H}){{0,{}}})?", 6 - a) };
        alts.push(format!("{}::{right}", left(a)));
    }
    // With an IPv4 tail (two groups): a + b <= 5.
    for a in 0..=5 {
        alts.push(format!("{}::({H}:){{0,{}}}{v4}", left(a), 5 - a));
    }
    format!("({})", alts.join("|"))
}

/// An IPv4 or IPv6 address (a nameserver).
pub static IP_ADDRESS: Pattern = Pattern::new(|| format!("^({}|{})$", ipv4(), ipv6()));

/// An address with its prefix length in CIDR form (`10.0.0.2/24`, `fd00::2/64`).
pub static CIDR: Pattern =
    Pattern::new(|| format!(r"^({}/(3[0-2]|[12]?[0-9])|{}/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))$", ipv4(), ipv6()));

/// flintlockd's gRPC address, `host:port`: printable ASCII without `/` (no scheme, no path) or
/// spaces, a port 1-65535 without sign or leading zero.
pub static HOST_ADDRESS: Pattern = Pattern::new(|| {
    r"^[!-.0-~]+:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$".into()
});

/// A PEM block (RFC 7468 text is ASCII): printable ASCII and line breaks, with a
/// `-----BEGIN ` line.
pub static PEM: Pattern = Pattern::new(|| r"^[\t\n\r -~]*-----BEGIN [\t\n\r -~]*$".into());

/// Text without control characters (Unicode Cc: what `char::is_control` refuses).
pub static NO_CONTROL: Pattern = Pattern::new(|| r"^[^\x00-\x1F\x7F-\x9F]*$".into());

/// A lease id in a path: what a lease id can be (ours are UUIDs).
pub static LEASE_ID: Pattern = Pattern::new(|| format!("^[A-Za-z0-9-]{{1,{MAX_LEASE_ID_CHARS}}}$"));

/// A `page_token`: unpadded base64url (of a page's last key; [`MAX_PAGE_TOKEN_CHARS`] at most), or
/// empty for the first page.
pub static PAGE_TOKEN: Pattern = Pattern::new(|| format!("^[A-Za-z0-9_-]{{0,{MAX_PAGE_TOKEN_CHARS}}}$"));

/// An HTTP header value as `HeaderValue::to_str` reads it: visible ASCII, space and tab.
pub static HEADER_TEXT: Pattern = Pattern::new(|| r"^[\t -~]*$".into());

/// Declares schema-only types: `Name = schema;`, or `Name [T, …] = schema;` when the schema
/// names the components `T, …` by `$ref`.
macro_rules! schema_only {
    ($($(#[$doc:meta])* $name:ident $([$($t:ty),+])? = $schema:expr;)+) => {$(
        $(#[$doc])*
        #[allow(dead_code)]
        pub struct $name;

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                ($schema).into()
            }
        }

        impl utoipa::ToSchema for $name {
            #[allow(unused_variables)]
            fn schemas(out: &mut Vec<(String, utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>)>) {
                $($(crate::rules::register::<$t>(out);)+)?
            }
        }
    )+};
}
pub(crate) use schema_only;

/// Adds `T` and the components it refers to, for a schema-only type that names `T` by `$ref`.
pub fn register<T: utoipa::ToSchema>(out: &mut Vec<(String, RefOr<Schema>)>) {
    out.push((T::name().into_owned(), T::schema()));
    T::schemas(out);
}

/// `$ref` to the component `T`.
pub fn reference<T: utoipa::ToSchema>() -> RefOr<Schema> {
    Ref::from_schema_name(T::name()).into()
}

pub fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

pub fn integer(min: i64, max: i64) -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(min)).maximum(Some(max))
}

/// A schema that only `null` satisfies: the field must be absent or null.
pub fn null() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::Null)
}

/// A schema that only these values satisfy, whatever their JSON types.
pub fn one_of_values<V: Into<serde_json::Value>>(values: impl IntoIterator<Item = V>) -> ObjectBuilder {
    ObjectBuilder::new().schema_type(utoipa::openapi::schema::SchemaType::any()).enum_values(Some(values))
}

/// An object schema with these properties (and no other rule).
pub fn object<'a>(props: impl IntoIterator<Item = (&'a str, ObjectBuilder)>) -> ObjectBuilder {
    props.into_iter().fold(ObjectBuilder::new(), |o, (k, v)| o.property(k, v))
}

schema_only! {
    /// Text that is not blank.
    NotBlank = string().pattern(Some(NOT_BLANK.as_str())).description(Some("Not blank"));
    /// A pool's size.
    PoolSize = integer(0, MAX_POOL_SIZE.into());
    /// MIN_SIZE_THRESHOLD's `min_size`: 1..=size.
    MinSize = integer(1, MAX_POOL_SIZE.into()).description(Some("At most the pool's `size`"));
    /// A hook command.
    Command = string()
        .pattern(Some(NOT_BLANK.as_str()))
        .max_length(Some(MAX_COMMAND_CHARS))
        .description(Some("A shell command run in the VM through flintlock's guest agent; not blank"));
    /// A pool's `create_commands` or `pre_lease_commands`.
    Commands [Command] = ArrayBuilder::new().items(reference::<Command>()).max_items(Some(MAX_COMMANDS));
    Vcpu = integer(VCPU.0.into(), VCPU.1.into()).description(Some(format!("Default {DEFAULT_VCPU}")));
    MemoryInMb = integer(MEMORY_IN_MB.0.into(), MEMORY_IN_MB.1.into())
        .description(Some(format!("Default {DEFAULT_MEMORY_IN_MB}")));
    Provider = string().enum_values(Some(PROVIDERS)).description(Some("Default firecracker"));
    DeviceId = string().pattern(Some(DEVICE_ID.as_str()));
    GuestMac = string().pattern(Some(GUEST_MAC.as_str())).description(Some("Empty: flintlock picks one"));
    /// An IP address.
    IpAddress = string().pattern(Some(IP_ADDRESS.as_str())).description(Some("An IPv4 or IPv6 address"));
    /// An address with its prefix length.
    Cidr = string().pattern(Some(CIDR.as_str())).description(Some("An IPv4 or IPv6 address in CIDR form"));
    /// Text of at least one character.
    NonEmpty = string().min_length(Some(1));
    HostAddress = string()
        .pattern(Some(HOST_ADDRESS.as_str()))
        .max_length(Some(MAX_HOST_ADDRESS_CHARS))
        .description(Some("`host:port` of flintlockd's gRPC API: no scheme, no path"));
    /// A PEM block.
    Pem = string()
        .pattern(Some(PEM.as_str()))
        .max_length(Some(MAX_PEM_CHARS))
        .description(Some("A PEM block (ASCII)"));
    BasicAuthToken = string()
        .pattern(Some(NO_CONTROL.as_str()))
        .min_length(Some(1))
        .max_length(Some(MAX_BASIC_AUTH_TOKEN_CHARS))
        .description(Some("Write-only: never returned; no control characters"));
    CordonReason = string().max_length(Some(MAX_CORDON_REASON_CHARS));
    /// The body's `request_id`.
    RequestIdText = string().max_length(Some(MAX_REQUEST_ID_BYTES)).description(Some(format!(
        "Idempotency key, at most {MAX_REQUEST_ID_BYTES} bytes (UTF-8; as many characters if ASCII); \
         empty or absent: every call claims a new VM"
    )));
    /// The `Idempotency-Key` header.
    IdempotencyKey = string().pattern(Some(HEADER_TEXT.as_str())).max_length(Some(MAX_REQUEST_ID_BYTES));
    LeaseIdText = string().pattern(Some(LEASE_ID.as_str()));
    PageToken = string().pattern(Some(PAGE_TOKEN.as_str()));
    PageSize = integer(1, MAX_PAGE_SIZE).description(Some(format!("Default {DEFAULT_PAGE_SIZE}")));
    EventsLimit = integer(1, MAX_EVENTS_LIMIT).description(Some(format!("Default {DEFAULT_EVENTS_LIMIT}")));
    WaitSeconds = integer(0, MAX_EVENTS_WAIT_SECONDS as i64).default(Some(0.into()));
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use rand::{RngExt, SeedableRng};

    use super::*;

    /// Candidate addresses around the valid forms: groups of 0-5 hex digits, zero to two
    /// `::`, IPv4 tails with leading zeros and big octets, stray separators.
    fn candidates(rng: &mut impl RngExt) -> String {
        let octet = |rng: &mut dyn rand::Rng| match rng.random_range(0..6) {
            0 => format!("0{}", rng.random_range(0..10)),
            1 => rng.random_range(250..260).to_string(),
            _ => rng.random_range(0..256).to_string(),
        };
        if rng.random_bool(0.3) {
            let n = rng.random_range(3..6);
            return (0..n).map(|_| octet(rng)).collect::<Vec<_>>().join(".");
        }
        let groups = rng.random_range(0..10);
        let mut parts: Vec<String> = (0..groups)
            .map(|_| {
                let len = if rng.random_bool(0.05) { rng.random_range(0..6) } else { rng.random_range(1..5) };
                (0..len).map(|_| b"0123456789abcdefABCDEF"[rng.random_range(0..22)] as char).collect()
            })
            .collect();
        for _ in 0..rng.random_range(0..3) {
            let at = rng.random_range(0..=parts.len());
            parts.insert(at, String::new());
        }
        let mut s = parts.join(":");
        if rng.random_bool(0.3) {
            let v4 = (0..4).map(|_| octet(rng)).collect::<Vec<_>>().join(".");
            s = if s.is_empty() || s.ends_with(':') { format!("{s}{v4}") } else { format!("{s}:{v4}") };
        }
        if rng.random_bool(0.05) {
            s.insert(rng.random_range(0..=s.len()), ':');
        }
        s
    }

    #[test]
    fn the_ip_patterns_accept_exactly_what_rust_parses() {
        for s in ["::", "::1", "1::", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "::ffff:1.2.3.4", "1::1.2.3.4", "0.0.0.0"] {
            assert!(IP_ADDRESS.is_match(s), "{s}");
        }
        for s in ["1:2:3:4:5:6::1.2.3.4", "00000::1", "::01.2.3.4", "1:::2", ":1::", "1.2.3", "fe80::1%eth0", ""] {
            assert!(!IP_ADDRESS.is_match(s), "{s}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        let (mut valid, mut total) = (0, 0);
        for _ in 0..200_000 {
            let s = candidates(&mut rng);
            let parsed = s.parse::<IpAddr>().is_ok();
            assert_eq!(IP_ADDRESS.is_match(&s), parsed, "{s:?}: the pattern and Rust's parser disagree");
            let v4 = s.parse::<Ipv4Addr>().is_ok();
            let v6 = s.parse::<Ipv6Addr>().is_ok();
            for bits in [0, 8, 32, 33, 64, 128, 129] {
                let cidr = format!("{s}/{bits}");
                let want = (v4 && bits <= 32) || (v6 && bits <= 128);
                assert_eq!(CIDR.is_match(&cidr), want, "{cidr:?}");
            }
            valid += usize::from(parsed);
            total += 1;
        }
        // The candidates reach both sides of the rule.
        assert!(valid > total / 10 && valid < total * 9 / 10, "{valid} of {total} valid");
        for bad in ["10.0.0.1/08", "10.0.0.1/+8", "10.0.0.1/", "10.0.0.1", "/24"] {
            assert!(!CIDR.is_match(bad), "{bad}");
        }
    }

    #[test]
    fn not_blank_is_what_trim_leaves_non_empty() {
        for c in (0..=0x3000u32).chain([0xFEFF, 0x205F, 0x3000]).filter_map(char::from_u32) {
            for s in [c.to_string(), format!(" {c}\t")] {
                assert_eq!(NOT_BLANK.is_match(&s), !s.trim().is_empty(), "{s:?}");
            }
        }
        assert!(!NOT_BLANK.is_match(""));
    }

    #[test]
    fn no_control_is_what_is_control_refuses() {
        for c in (0..=0x3000u32).filter_map(char::from_u32) {
            assert_eq!(NO_CONTROL.is_match(&format!("a{c}b")), !c.is_control(), "{c:?}");
        }
    }

    #[test]
    fn host_addresses_have_a_port_from_1_to_65535() {
        for ok in ["10.0.0.5:9090", "localhost:1", "h:65535", "[::1]:9090", "::1:80"] {
            assert!(HOST_ADDRESS.is_match(ok), "{ok}");
        }
        for bad in ["h:0", "h:65536", "h:080", "h:+80", ":80", "h", "http://h:80", "h :80", "hé:80", "h:80/x"] {
            assert!(!HOST_ADDRESS.is_match(bad), "{bad}");
        }
        for port in 0..=70_000u32 {
            let want = (1..=65535).contains(&port);
            assert_eq!(HOST_ADDRESS.is_match(&format!("h:{port}")), want, "{port}");
        }
    }

    #[test]
    fn the_longest_page_token_encodes_the_longest_key() {
        use base64::Engine;
        const { assert!(MAX_PAGE_KEY_CHARS >= MAX_LEASE_ID_CHARS && MAX_PAGE_KEY_CHARS >= 63 + 1 + 63) };
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("a".repeat(MAX_PAGE_KEY_CHARS));
        assert_eq!(token.len(), MAX_PAGE_TOKEN_CHARS);
        assert!(PAGE_TOKEN.is_match(&token));
    }
}

# shellcheck shell=bash
# Calling the HTTP API from a script and checking its JSON answers, one request at a time, the
# last answer kept in files so a failure can show it (lambda-smoke.sh). Needs curl and
# python3; sources nothing, uses die from common.sh.
#
#   http_init DIR                 answers go to DIR/body.json and DIR/headers.txt
#                                 (HTTP_BODY, HTTP_HEADERS)
#   http_call METHOD URL TOKEN [BODY]  one request with a bearer token (and a JSON body);
#                                 sets CODE and SECS (curl's time_total); dies on no answer
#   http_expect CODE WHAT         die, showing the body, unless the last answer had status CODE
#   http_json EXPR                print a Python expression over the last body, bound to `b`
#                                 (dicts, lists, booleans and null as JSON)
#   http_check EXPR WHAT          die, showing the body, unless EXPR is true
#   http_ms SECONDS               SECONDS in milliseconds, one decimal
#
# Never: retries a request or hides an answer it did not expect.

http_init() {
    HTTP_BODY=$1/body.json
    HTTP_HEADERS=$1/headers.txt
}

http_call() {
    local method=$1 url=$2 token=$3 data=${4:-} out
    local args=(-sS -X "$method" -o "$HTTP_BODY" -D "$HTTP_HEADERS" --max-time 300
        -w '%{http_code} %{time_total}' -H "Authorization: Bearer $token")
    if [[ -n "$data" ]]; then
        args+=(-H 'content-type: application/json' --data "$data")
    fi
    out=$(curl "${args[@]}" "$url") || die "$method $url: no answer"
    # shellcheck disable=SC2034  # both read by the caller
    CODE=${out% *} SECS=${out#* }
}

http_expect() {
    local want=$1 what=$2
    if [[ "$CODE" != "$want" ]]; then
        printf 'answer body: %s\n' "$(cat "$HTTP_BODY" 2>/dev/null)" >&2
        die "$what: expected HTTP $want, got $CODE"
    fi
}

http_json() {
    python3 -c 'import json, sys
b = json.load(open(sys.argv[1]))
v = eval(sys.argv[2])
print(json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v)' "$HTTP_BODY" "$1"
}

http_check() {
    local expr=$1 what=$2
    [[ "$(http_json "$expr")" == true ]] || {
        printf 'answer body: %s\n' "$(cat "$HTTP_BODY")" >&2
        die "$what"
    }
}

http_ms() { python3 -c 'import sys; print(round(float(sys.argv[1]) * 1000, 1))' "$1"; }

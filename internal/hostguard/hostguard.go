// Package hostguard makes an HTTP server answer only requests addressed to
// its own names, which defeats DNS rebinding.
package hostguard

import (
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
)

// AllowedHostsEnv is the environment variable km0 reads the extra allowed
// Host names of its HTTP servers from (comma separated; see Wrap).
const AllowedHostsEnv = "KM0_HTTP_ALLOWED_HOSTS"

// codeUnknownHost is the codi of the 421 answer: svc.CodeUnknownHost.
const codeUnknownHost = "host_desconegut"

// Wrap wraps h so that it answers only requests whose Host header names
// this server, which defeats DNS rebinding (a web page whose own host name
// resolves to this server's address reading its API through the visitor's
// browser). listen is the address the server listens on. Allowed are:
//   - an IP address (v4, or v6 in brackets) with the listen port, when it is
//     the listen address, or both are loopback, or the server listens on all
//     addresses (0.0.0.0, ::);
//   - "localhost" with the listen port, when listening on loopback or on all
//     addresses;
//   - each entry of allowed: "name" (any port) or "name:port"; "*" allows
//     every Host (no check).
//
// Names compare case-insensitively; port 80 may be left out. Any other Host,
// or none, gets 421 Misdirected Request and h does not run.
func Wrap(h http.Handler, listen net.Addr, allowed []string) http.Handler {
	g := &hostGuard{h: h, names: map[string]bool{}}
	if ta, ok := listen.(*net.TCPAddr); ok {
		g.ip, g.port = ta.IP, strconv.Itoa(ta.Port)
	} else if host, port, err := net.SplitHostPort(listen.String()); err == nil {
		g.ip, g.port = net.ParseIP(host), port
	}
	for _, a := range allowed {
		a = strings.ToLower(strings.TrimSpace(a))
		switch {
		case a == "":
		case a == "*":
			g.any = true
		default:
			if host, port, err := net.SplitHostPort(a); err == nil {
				g.names[net.JoinHostPort(host, port)] = true
			} else {
				g.names[strings.TrimSuffix(strings.TrimPrefix(a, "["), "]")] = true
			}
		}
	}
	return g
}

type hostGuard struct {
	h     http.Handler
	ip    net.IP
	port  string
	any   bool
	names map[string]bool // "name" or "name:port", lower case
}

func (g *hostGuard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !g.allows(r.Host) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusMisdirectedRequest)
		// The services' error body (svc.ErrorBody), written here without
		// importing them.
		_ = json.NewEncoder(w).Encode(struct {
			Error string `json:"error"`
			Code  string `json:"codi"`
			Field string `json:"camp"`
		}{"this server does not answer to this host name (see " + AllowedHostsEnv + ")", codeUnknownHost, "Host"})
		return
	}
	g.h.ServeHTTP(w, r)
}

func (g *hostGuard) allows(hostport string) bool {
	if g.any {
		return true
	}
	hostport = strings.ToLower(hostport)
	if hostport == "" {
		return false
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil { // no port
		host, port = strings.TrimSuffix(strings.TrimPrefix(hostport, "["), "]"), "80"
	}
	if g.names[host] || g.names[net.JoinHostPort(host, port)] {
		return true
	}
	if port != g.port || g.ip == nil {
		return false
	}
	if host == "localhost" {
		return g.ip.IsLoopback() || g.ip.IsUnspecified()
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return false
	}
	return g.ip.IsUnspecified() || ip.Equal(g.ip) || (ip.IsLoopback() && g.ip.IsLoopback())
}

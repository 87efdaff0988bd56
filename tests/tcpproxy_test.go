package tests

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// tcpProxy forwards connections to the server of a DSN, and can cut them
// all (and refuse new ones) until restored: a network path that fails
// while the server and every other connection stay up.
type tcpProxy struct {
	addr     string // where clients connect
	target   string
	mu       sync.Mutex
	refusing bool
	conns    []net.Conn
}

// startTCPProxy starts a proxy to dsn's server, closed when the test ends.
func startTCPProxy(t *testing.T, dsn string) *tcpProxy {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	require.NotEmpty(t, u.Host, "the test database's DSN must be a URL with a host: %s", dsn)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &tcpProxy{addr: ln.Addr().String(), target: u.Host}
	t.Cleanup(func() { _ = ln.Close(); p.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return // the test ended
			}
			p.forward(c)
		}
	}()
	return p
}

// forward connects c to the target, or closes it while the path is cut.
func (p *tcpProxy) forward(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock() // a cut waits for a connection being made, and closes it
	if p.refusing {
		_ = c.Close()
		return
	}
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.conns = append(p.conns, c, up)
	go func() { _, _ = io.Copy(up, c); _ = up.Close() }()
	go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
}

// cut closes every proxied connection and refuses new ones (the listener
// stays, so that no other process takes its port meanwhile).
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refusing = true
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// restore forwards new connections again.
func (p *tcpProxy) restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refusing = false
}

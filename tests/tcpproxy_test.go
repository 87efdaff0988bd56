package tests

import (
	"bytes"
	"net"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// tcpProxy forwards connections to the server of a DSN, and can cut them
// all (and refuse new ones) until restored: a network path that fails
// while the server and every other connection stay up. It can also fall
// silent: a half-open path, where the server's side is closed and the
// client's stays open and hears nothing.
type tcpProxy struct {
	addr     string // where clients connect
	target   string
	mu       sync.Mutex
	refusing bool
	silent   bool
	pairs    []proxied
	held     []net.Conn    // clients kept open and silent
	stallEnd time.Time     // the server's bytes reach the clients from then on
	holdEnd  time.Time     // the clients' bytes reach the server from then on
	closed   chan struct{} // closed when the test ends: held bytes are dropped
}

type proxied struct{ client, server net.Conn }

// startTCPProxy starts a proxy to dsn's server, closed when the test ends.
func startTCPProxy(t *testing.T, dsn string) *tcpProxy {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	require.NotEmpty(t, u.Host, "the test database's DSN must be a URL with a host: %s", dsn)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &tcpProxy{addr: ln.Addr().String(), target: u.Host, closed: make(chan struct{})}
	t.Cleanup(func() { _ = ln.Close(); close(p.closed); p.cut() })
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

// forward connects c to the target, closes it while the path is cut, or
// keeps it open and silent while the path is silent.
func (p *tcpProxy) forward(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock() // a cut waits for a connection being made, and closes it
	switch {
	case p.refusing:
		_ = c.Close()
		return
	case p.silent:
		p.held = append(p.held, c)
		return
	}
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.pairs = append(p.pairs, proxied{c, up})
	go func() { p.copyHeld(up, c, &p.holdEnd); _ = up.Close(); p.serverEnded(c) }()
	go func() { p.copyHeld(c, up, &p.stallEnd); p.serverEnded(c) }()
}

// copyHeld copies src to dst, each chunk once the time at until (read
// under the lock) has come, or not at all once the test ended.
func (p *tcpProxy) copyHeld(dst, src net.Conn, until *time.Time) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			end := *until
			p.mu.Unlock()
			if wait := time.Until(end); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-p.closed:
					t.Stop()
					return
				}
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// stall holds back what the server sends for d (new connections' too),
// then delivers it: a path that stops for a moment and goes on.
func (p *tcpProxy) stall(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stallEnd = time.Now().Add(d)
}

// pool is a pool of b's database through the proxy (bundle.poolWith),
// its connections named app, adjusted by mod (nil: none).
func (p *tcpProxy) pool(t *testing.T, b *bundle, app string, mod func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	host, port, err := net.SplitHostPort(p.addr)
	require.NoError(t, err)
	n, err := strconv.ParseUint(port, 10, 16)
	require.NoError(t, err)
	return b.poolWith(t, map[string]string{"application_name": app}, func(c *pgxpool.Config) {
		c.ConnConfig.Host, c.ConnConfig.Port, c.ConnConfig.Fallbacks = host, uint16(n), nil
		if mod != nil {
			mod(c)
		}
	})
}

// hold holds back what the clients send for d (new connections' too),
// then delivers it: a path that stops forwarding and later delivers what
// it held, as TCP retransmits after a partition heals. A client that gave
// up meanwhile has its statements run all the same.
func (p *tcpProxy) hold(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.holdEnd = time.Now().Add(d)
}

// serverEnded closes the client's side of a connection whose server side
// ended, unless the path is silent: then the client hears nothing.
func (p *tcpProxy) serverEnded(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !slices.Contains(p.held, c) {
		_ = c.Close()
	}
}

// cut closes every proxied connection and refuses new ones (the listener
// stays, so that no other process takes its port meanwhile).
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refusing = true
	p.closeAll()
}

// silence closes the server's side of every proxied connection (the server
// ends those sessions, and drops their locks) and keeps the clients' sides
// open, hearing nothing, as it keeps new connections: a half-open path.
func (p *tcpProxy) silence() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.silent = true
	for _, pr := range p.pairs {
		p.held = append(p.held, pr.client)
	}
	for _, pr := range p.pairs {
		_ = pr.server.Close()
	}
	p.pairs = nil
}

// strand makes every proxied connection half-open, as silence does, while
// new connections are forwarded: a path whose state a middlebox lost (a NAT
// or firewall restart), where a new connection works at once.
func (p *tcpProxy) strand() {
	p.silence()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.silent = false
}

// restore forwards new connections again; the connections kept silent are
// reset, as a path that comes back answers a dead connection's next packet.
func (p *tcpProxy) restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refusing, p.silent = false, false
	for _, c := range p.held {
		_ = c.Close()
	}
	p.held = nil
}

func (p *tcpProxy) closeAll() {
	for _, pr := range p.pairs {
		_ = pr.client.Close()
		_ = pr.server.Close()
	}
	for _, c := range p.held {
		_ = c.Close()
	}
	p.pairs, p.held = nil, nil
}

// serveProxy listens on a port of its own and hands every connection
// made to it, with a new connection to dsn's server, to serve; all of them
// are closed when the test ends. It returns its address.
func serveProxy(t *testing.T, dsn string, serve func(client, server net.Conn)) string {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", u.Host)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, up)
			mu.Unlock()
			serve(c, up)
		}
	}()
	return ln.Addr().String()
}

// startDelayProxy forwards connections to dsn's server, each chunk of
// bytes d later than it came, in both directions (a round trip of 2d, as to
// a server in another region), closed when the test ends. It returns its
// address.
func startDelayProxy(t *testing.T, dsn string, d time.Duration) string {
	t.Helper()
	pipe := func(dst, src net.Conn) {
		type chunk struct {
			b  []byte
			at time.Time
		}
		ch := make(chan chunk, 1024)
		go func() {
			for c := range ch {
				time.Sleep(time.Until(c.at))
				if _, err := dst.Write(c.b); err != nil {
					break
				}
			}
			_ = dst.Close()
		}()
		buf := make([]byte, 64<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				ch <- chunk{append([]byte(nil), buf[:n]...), time.Now().Add(d)}
			}
			if err != nil {
				_ = src.Close()
				close(ch)
				return
			}
		}
	}
	return serveProxy(t, dsn, func(c, up net.Conn) {
		go pipe(up, c)
		go pipe(c, up)
	})
}

// trapProxy forwards connections to a DSN's server; once armed, the first
// connection whose client sends the text trigger goes silent in both
// directions from then on, nothing closed: a path that breaks in the
// middle of a session's set-up. With answerOnly the statement with the
// trigger still reaches the server, and only what the server sends after
// it is lost: a COMMIT that commits, its client left not knowing.
type trapProxy struct {
	addr       string
	trigger    []byte
	answerOnly bool
	armed      atomic.Bool
	trapped    atomic.Int32
}

func startTrapProxy(t *testing.T, dsn, trigger string) *trapProxy {
	t.Helper()
	return serveTrap(t, dsn, &trapProxy{trigger: []byte(trigger)})
}

// startAnswerTrapProxy is startTrapProxy with answerOnly.
func startAnswerTrapProxy(t *testing.T, dsn, trigger string) *trapProxy {
	t.Helper()
	return serveTrap(t, dsn, &trapProxy{trigger: []byte(trigger), answerOnly: true})
}

func serveTrap(t *testing.T, dsn string, p *trapProxy) *trapProxy {
	t.Helper()
	p.addr = serveProxy(t, dsn, func(c, up net.Conn) {
		var stuck atomic.Bool
		pipe := func(dst, src net.Conn, fromClient bool) {
			buf := make([]byte, 64<<10)
			for {
				n, err := src.Read(buf)
				if n > 0 && fromClient && bytes.Contains(buf[:n], p.trigger) && p.armed.CompareAndSwap(true, false) {
					stuck.Store(true)
					p.trapped.Add(1)
				}
				passes := !stuck.Load() || p.answerOnly && fromClient
				if n > 0 && passes {
					if _, err := dst.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					if passes {
						_ = dst.Close()
					}
					return
				}
			}
		}
		go pipe(up, c, true)
		go pipe(c, up, false)
	})
	return p
}

// pool is a pool of b's database through the proxy, as tcpProxy.pool.
func (p *trapProxy) pool(t *testing.T, b *bundle, app string) *pgxpool.Pool {
	t.Helper()
	return (&tcpProxy{addr: p.addr}).pool(t, b, app, nil)
}

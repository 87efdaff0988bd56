package main

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// faultProxy forwards TCP connections to a broker and can drop all of
// them at once, as a network fault or a broker-side disconnect would.
// New connections are accepted again right after, so clients reconnect.
type faultProxy struct {
	addr   string
	target string
	mu     sync.Mutex
	conns  []net.Conn
	cuts   atomic.Int32
}

func startFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{addr: ln.Addr().String(), target: target}
	t.Cleanup(func() { ln.Close(); p.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.forward(c)
		}
	}()
	return p
}

func (p *faultProxy) forward(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		client.Close()
		return
	}
	p.mu.Lock()
	p.conns = append(p.conns, client, server)
	p.mu.Unlock()
	go func() { _, _ = io.Copy(server, client); server.Close() }()
	_, _ = io.Copy(client, server)
	client.Close()
}

// cut closes every connection through the proxy.
func (p *faultProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.cuts.Add(1)
}

package main

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats.go"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay/relaytest"
)

// BenchmarkJetStream compares the relay with publishing straight to
// JetStream, both waiting for JetStream's acknowledgement of each message,
// with the same concurrency:
//
//	go test -run '^$' -bench . -benchtime 20000x
func BenchmarkJetStream(b *testing.B) {
	conn, err := nats.Connect("nats://" + brokerAddr)
	if err != nil {
		b.Skipf("NATS is not reachable at %s: %v", brokerAddr, err)
	}
	b.Cleanup(conn.Close)
	pub, err := wmnats.NewPublisherWithNatsConn(conn, publisherConfig(), watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	for _, workers := range []int{1, 4} {
		stream := "pgoutbox-bench-" + watermill.NewShortUUID()
		b.Cleanup(func() { deleteStream(conn, stream) })
		b.Run(fmt.Sprintf("relay/workers=%d", workers), func(b *testing.B) {
			relaytest.BenchRelay(b, pub, stream, workers, 100)
		})
		b.Run(fmt.Sprintf("direct/workers=%d", workers), func(b *testing.B) {
			relaytest.BenchDirect(b, pub, stream, workers, 100)
		})
	}
}

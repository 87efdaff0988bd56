package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats.go"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay/relaytest"
)

const brokerAddr = "127.0.0.1:4222"

// requireBroker skips where NATS is not reachable, unless
// PGOUTBOX_REQUIRE_BROKERS is set (CI sets it: there, a missing broker
// is a failure, not a skip).
func requireBroker(t *testing.T) {
	t.Helper()
	c, err := net.DialTimeout("tcp", brokerAddr, 2*time.Second)
	if err == nil {
		c.Close()
		return
	}
	msg := fmt.Sprintf("NATS is not reachable at %s (%v): start nats-server with JetStream (-js) to run the relay tests", brokerAddr, err)
	if os.Getenv("PGOUTBOX_REQUIRE_BROKERS") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// The example runs against POSTGRES_DSN and NATS, and fails unless
// JetStream delivered every order and the outbox ended empty.
func TestExample(t *testing.T) {
	requireBroker(t)
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

// 10,000 messages relayed to JetStream while the relay's NATS connection
// is dropped twice (the client closes it and reconnects) and the relay
// process is replaced once: every message reaches JetStream at least
// once, the outbox ends empty, and no outbox row is acked before
// JetStream acknowledged its message (relaytest.Run checks all three).
func TestRelaySurvivesDroppedBrokerConnections(t *testing.T) {
	requireBroker(t)
	url := "nats://" + brokerAddr
	stream := "pgoutbox-test-relay-" + watermill.NewShortUUID()
	conn, err := nats.Connect(url, nats.ReconnectWait(50*time.Millisecond), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteStream(conn, stream); conn.Close() })
	consumer, err := wmnats.NewSubscriber(subscriberConfig(url), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { consumer.Close() })
	received, err := consumer.Subscribe(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	target, err := wmnats.NewPublisherWithNatsConn(conn, publisherConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	dropConnection := func() {
		if err := conn.ForceReconnect(); err != nil {
			t.Fatal(err)
		}
	}
	relaytest.Run(t, relaytest.Config{
		Target:      target,
		Received:    received,
		TargetTopic: stream,
		Faults: []relaytest.Fault{
			{Name: "drop the NATS connection", Do: dropConnection},
			{Name: "replace the relay process", ReplaceRelay: true},
			{Name: "drop the NATS connection", Do: dropConnection},
		},
	})
	if got := conn.Stats().Reconnects; got < 2 {
		t.Fatalf("the connection reconnected %d times, want at least 2", got)
	}
}

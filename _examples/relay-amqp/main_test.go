package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay/relaytest"
)

const brokerAddr = "127.0.0.1:5672"

// requireBroker skips where RabbitMQ is not reachable, unless
// PGOUTBOX_REQUIRE_BROKERS is set (CI sets it: there, a missing broker
// is a failure, not a skip).
func requireBroker(t *testing.T) {
	t.Helper()
	c, err := net.DialTimeout("tcp", brokerAddr, 2*time.Second)
	if err == nil {
		c.Close()
		return
	}
	msg := fmt.Sprintf("RabbitMQ is not reachable at %s (%v): start it (rabbitmq-server -detached) to run the relay tests", brokerAddr, err)
	if os.Getenv("PGOUTBOX_REQUIRE_BROKERS") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// The example runs against POSTGRES_DSN and RabbitMQ, and fails unless
// RabbitMQ delivered every order and the outbox ended empty.
func TestExample(t *testing.T) {
	requireBroker(t)
	if err := run(); err != nil {
		t.Fatal(err)
	}
}

// 10,000 messages relayed to RabbitMQ while the relay's broker connection
// is dropped twice (by a proxy that closes it, as a network fault would)
// and the relay process is replaced once: every message reaches RabbitMQ
// at least once, the outbox ends empty, and no outbox row is acked before
// RabbitMQ confirmed its message (relaytest.Run checks all three).
func TestRelaySurvivesDroppedBrokerConnections(t *testing.T) {
	requireBroker(t)
	queue := "pgoutbox-test.relay." + watermill.NewShortUUID()
	consumer, err := amqp.NewSubscriber(brokerConfig("amqp://guest:guest@"+brokerAddr+"/"), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { consumer.Close() })
	received, err := consumer.Subscribe(context.Background(), queue) // declares the queue
	if err != nil {
		t.Fatal(err)
	}

	proxy := startFaultProxy(t, brokerAddr)
	cfg := brokerConfig("amqp://guest:guest@" + proxy.addr + "/")
	cfg.Connection.Reconnect = &amqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 1.5, BackoffMaxInterval: time.Second}
	target, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Close() })

	relaytest.Run(t, relaytest.Config{
		Target:      target,
		Received:    received,
		TargetTopic: queue,
		Faults: []relaytest.Fault{
			{Name: "drop the broker connection", Do: proxy.cut},
			{Name: "replace the relay process", ReplaceRelay: true},
			{Name: "drop the broker connection", Do: proxy.cut},
		},
	})
	if proxy.cuts.Load() != 2 {
		t.Fatalf("%d connection drops, want 2", proxy.cuts.Load())
	}
}

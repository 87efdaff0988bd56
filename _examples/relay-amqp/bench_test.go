package main

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/relay/relaytest"
)

// BenchmarkRabbitMQ compares the relay with publishing straight to
// RabbitMQ, both with publisher confirms and the same concurrency:
//
//	go test -run '^$' -bench . -benchtime 20000x
func BenchmarkRabbitMQ(b *testing.B) {
	pub, err := amqp.NewPublisher(brokerConfig("amqp://guest:guest@"+brokerAddr+"/"), watermill.NopLogger{})
	if err != nil {
		b.Skipf("RabbitMQ is not reachable at %s: %v", brokerAddr, err)
	}
	b.Cleanup(func() { pub.Close() })
	for _, workers := range []int{1, 4} {
		// No consumer: the queue keeps what it gets and expires a minute
		// after the run.
		queue := "pgoutbox-bench." + watermill.NewShortUUID()
		if err := declareQueue(queue); err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("relay/workers=%d", workers), func(b *testing.B) {
			relaytest.BenchRelay(b, pub, queue, workers, 100)
		})
		b.Run(fmt.Sprintf("direct/workers=%d", workers), func(b *testing.B) {
			relaytest.BenchDirect(b, pub, queue, workers, 100)
		})
	}
}

// declareQueue creates the queue (a subscriber's topology), so published
// messages are routed to it.
func declareQueue(queue string) error {
	sub, err := amqp.NewSubscriber(brokerConfig("amqp://guest:guest@"+brokerAddr+"/"), watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer sub.Close()
	return sub.SubscribeInitialize(queue)
}

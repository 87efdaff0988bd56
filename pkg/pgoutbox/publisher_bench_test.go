package pgoutbox

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// nopExecutor is a transaction that runs nothing: what is left of a Publish
// is the Publisher's own work (building the publisher, checking and
// encoding the messages), the client cost pgx and the server add to.
type nopExecutor struct{}

func (nopExecutor) Exec(context.Context, string, ...any) (int64, error) { return 1, nil }
func (nopExecutor) Query(context.Context, string, ...any) (tx.Rows, error) {
	panic("the plain publish statements are Exec")
}
func (nopExecutor) InTx() bool { return true }

// BenchmarkPublisherOverhead is the Publisher's cost per transaction on top
// of its statement: go test -run '^$' -bench PublisherOverhead -benchmem ./pkg/pgoutbox
func BenchmarkPublisherOverhead(b *testing.B) {
	payload := make([]byte, 200)
	for _, perTx := range []int{1, 100} {
		msgs := make([]*message.Message, perTx)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
			msgs[i].Metadata.Set("correlation_id", watermill.NewUUID())
		}
		b.Run(map[int]string{1: "1-per-tx", 100: "100-per-tx"}[perTx], func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				p, err := NewPublisher(nopExecutor{}, PublisherConfig{}, nil)
				if err != nil {
					b.Fatal(err)
				}
				if err := p.Publish("bench", msgs...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

package relay

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

var errRefused = errors.New("refused for good")

// scriptedTarget answers each Publish call with the next error of its
// script (nil: taken), and records the UUIDs of each call.
type scriptedTarget struct {
	script []error
	calls  [][]string
}

func (s *scriptedTarget) Publish(_ string, msgs ...*message.Message) error {
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.UUID)
	}
	s.calls = append(s.calls, ids)
	if len(s.calls) > len(s.script) {
		return errors.New("called more often than scripted")
	}
	return s.script[len(s.calls)-1]
}

func (s *scriptedTarget) Close() error { return nil }

// A batch the target refused for good is published again one message at
// a time: a refused message is rejected, the others are acked, and the
// first failure of another kind (an outage) stops the split: that message
// and the rest are nacked, to come back once the target is up, without a
// call each while it is down.
func TestSplitStopsAtTheFirstOutage(t *testing.T) {
	t.Parallel()
	target := &scriptedTarget{script: []error{
		fmt.Errorf("batch: %w", errRefused), // the batch
		nil,                                 // m1
		fmt.Errorf("m2: %w", errRefused),    // m2
		errors.New("broker unreachable"),    // m3: down
	}}
	r := &Relay{cfg: Config{PublishTimeout: time.Second, Refused: func(err error) bool { return errors.Is(err, errRefused) }},
		target: target, logger: watermill.NopLogger{}, closed: make(chan struct{})}
	var batch []*message.Message
	for i := 1; i <= 4; i++ {
		batch = append(batch, message.NewMessage(fmt.Sprintf("m%d", i), nil))
	}
	r.relay(context.Background(), "t", "t", batch, newOutage())

	require.Equal(t, [][]string{{"m1", "m2", "m3", "m4"}, {"m1"}, {"m2"}, {"m3"}}, target.calls, "no call for m4 while the target is down")
	closed := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	require.True(t, closed(batch[0].Acked()))
	require.True(t, closed(batch[1].Nacked()), "rejected: the subscriber dead-letters it on the nack")
	require.True(t, closed(batch[2].Nacked()))
	require.True(t, closed(batch[3].Nacked()))
	st := r.Stats()
	require.EqualValues(t, 1, st.Relayed)
	require.EqualValues(t, 1, st.Refused)
	require.EqualValues(t, 4, st.Batches)
}

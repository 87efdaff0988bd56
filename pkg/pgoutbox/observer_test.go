package pgoutbox

import (
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

type recordingObserver struct {
	mu     sync.Mutex
	events []EventKind
}

func (r *recordingObserver) Observe(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e.Kind)
}

// An event queue runs its goroutine from its first event: a Subscriber
// that never subscribed (cqrsbind's, built to read a group) holds none and
// need not be closed. Events queued before close are delivered; later
// ones are not.
func TestEventQueueStartsWithItsFirstEvent(t *testing.T) {
	t.Parallel()
	idle := newEventQueue(safeObserver{o: &recordingObserver{}, logger: watermill.NopLogger{}})
	require.False(t, idle.started)
	idle.close() // returns without a goroutine to wait for

	rec := &recordingObserver{}
	q := newEventQueue(safeObserver{o: rec, logger: watermill.NopLogger{}})
	q.observe(Event{Kind: EventClaimed})
	q.observe(Event{Kind: EventAcked})
	require.True(t, q.started)
	q.close()
	q.observe(Event{Kind: EventReleased})
	require.Equal(t, []EventKind{EventClaimed, EventAcked}, rec.events)
}

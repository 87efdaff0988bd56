package pgoutbox

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// recentAcks keeps the acks of the last recentAckWindow, at most
// maxRecentAcks of them, and an idle subscription lets go of them; what
// is written again is the newest token of each row (a row acked,
// delivered again and acked again was deleted under the later one).
func TestRecentAcksKeepsTheLastWindow(t *testing.T) {
	var r recentAcks
	t0 := at(time.Now())
	for i := range maxRecentAcks + 10 {
		r.add(ackedRow{id: int64(i), at: t0.add(time.Duration(i) * time.Microsecond)})
	}
	all := r.latest()
	require.Len(t, all, maxRecentAcks)
	require.Equal(t, int64(10), all[0].id, "the oldest ten made room")
	require.Equal(t, int64(maxRecentAcks+9), all[len(all)-1].id)
	require.LessOrEqual(t, cap(r.rows), 2*maxRecentAcks+1, "the slice is compacted, not grown")

	r.add(ackedRow{id: 1, at: t0.add(recentAckWindow + time.Second)})
	require.Len(t, r.latest(), 1, "those older than the window are gone")
	r.trim(t0.add(3 * recentAckWindow))
	require.Empty(t, r.latest())
	require.Nil(t, r.rows, "an idle subscription keeps none")

	got := lastOfEachRow([]ackedRow{{id: 7, token: [16]byte{1}}, {id: 8}, {id: 7, token: [16]byte{2}}})
	require.Len(t, got, 2)
	require.Equal(t, int64(7), got[0].id)
	require.Equal(t, byte(2), got[0].token[0], "the later ack of row 7")
}

// Writing lost acks again waits for the liveness lock (until then the
// server is likely down), and a failure backs off: retried at once, a
// failing write went out every millisecond for a whole Lease.
func TestAFailedReackBacksOff(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.sub.writes.reacks = []ackedRow{{id: 1}}
	b.sub.writes.reacksUntil = time.Now().Add(time.Minute)
	job := writeJob{reacks: b.sub.writes.reacks}
	b.sub.writes.inWrite = true
	b.sub.onWritten(writeResult{job: job, reackErr: errors.New("the database system is starting up")})
	require.True(t, b.sub.writes.gate.shut(), "the next write waits")
	require.Len(t, b.sub.writes.reacks, 1, "kept for a later write")

	b.sub.writes.inWrite = true
	b.sub.onWritten(writeResult{job: job})
	require.Empty(t, b.sub.writes.reacks, "written")
}

// The lock lapses (the LISTEN connection went with a crashed server)
// before the report of the write the crash interrupted comes: its acks,
// reported after the lapse, are written again too. They were left out,
// and their rows stayed leased for a Lease.
func TestAcksReportedAfterALapseAreWrittenAgainToo(t *testing.T) {
	t.Parallel()
	b := setup(t, nil) // its notifier never connects: the lock is not held
	b.sub.writes.ackWritten(ackedRow{id: 1, at: at(time.Now())})
	b.sub.reackRecent(time.Now()) // the lapse
	require.Len(t, b.sub.writes.reacks, 1)
	b.sub.writes.ackWritten(ackedRow{id: 2, at: at(time.Now())}) // the interrupted write's report
	require.Len(t, b.sub.writes.reacks, 2)

	b.sub.writes.inWrite = true
	b.sub.onWritten(writeResult{job: writeJob{reacks: b.sub.writes.reacks}})
	require.Empty(t, b.sub.writes.reacks)
	b.sub.writes.ackWritten(ackedRow{id: 3, at: at(time.Now())})
	require.Empty(t, b.sub.writes.reacks, "once written, later acks are not")
}

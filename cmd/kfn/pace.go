package main

import "time"

// pacer spreads rate events a second evenly over time: however often it is
// asked, due says how many events are due since the last call, so that the
// count after t seconds is rate × t within one event, whatever the tick.
type pacer struct {
	rate  float64
	start time.Time
	sent  int64
}

func newPacer(rate float64, start time.Time) *pacer { return &pacer{rate: rate, start: start} }

// due returns how many events to send now.
func (p *pacer) due(now time.Time) int {
	want := int64(p.rate * now.Sub(p.start).Seconds())
	n := want - p.sent
	if n < 0 {
		return 0
	}
	p.sent = want
	return int(n)
}

// tick is how often to ask a pacer: often enough to spread the events
// (about 20 per second at most), never busier than every 5 ms.
func (p *pacer) tick() time.Duration {
	return max(5*time.Millisecond, min(50*time.Millisecond, time.Duration(float64(time.Second)/p.rate)))
}

package devstack

import (
	"net"
	"strconv"
	"testing"
)

func TestFreePortIsBelowTheEphemeralRangeAndBindable(t *testing.T) {
	low := ephemeralLow()
	for range 20 {
		port, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		if port >= low {
			t.Fatalf("FreePort gave %d, inside the ephemeral range that starts at %d", port, low)
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			t.Fatalf("FreePort gave %d, which cannot be bound: %v", port, err)
		}
		l.Close()
	}
}

func TestFreePortSkipsABoundPort(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	bound := l.Addr().(*net.TCPAddr).Port
	if free(bound) {
		t.Fatalf("free(%d) is true while a listener holds it", bound)
	}
}

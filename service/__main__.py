from framewire.service._cli.main import main

raise SystemExit(main())
